"""Transform: traces to credit-assigned transition datasets (`nightshift build`).

spans/ (+ logs/, feedback/) -> `build` reads whole traces by bucket ->
`calls` (which spans are LLM calls, agents, reward carriers; one record per call,
read by the layout readers of `conventions` into the `messages` shape) ->
trajectories -> `rewards` -> `credit` (assignment and advantages) -> `output`
(one date partition at a time, replaced whole). Settings: `config`.
"""
