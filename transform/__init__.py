"""Transform: traces to credit-assigned transition datasets (issue 3, in progress).

Built so far: `messages`, the one message shape every instrumentation's layout is
read into; `conventions`, readers for the OTel GenAI JSON, OpenInference and
OpenLLMetry (pre-0.55) span layouts and the GenAI log events; `classify`, which
spans are LLM calls and which agent encloses them; and the `transitions` schema in
`nightshift.schemas`. Still to come: producer quirks, Agent Lightning's layout,
trajectories, rewards and feedback, credit assignment, `nightshift build`, and the
tests against live instrumentation packages.
"""
