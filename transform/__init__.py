"""Transform: traces to credit-assigned transition datasets (issue 3, in progress).

Built so far: `messages`, the one message shape every instrumentation's layout is
read into; `conventions`, readers for the OTel GenAI JSON, OpenInference and
OpenLLMetry (pre-0.55) span layouts; and the `transitions` schema in
`nightshift.schemas`. Still to come: log-event layouts and producer quirks,
trajectories, rewards, credit assignment, `nightshift build`.
"""
