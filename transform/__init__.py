"""Transform: traces to credit-assigned transition datasets (issue 3, in progress).

Built so far: `messages`, the one message shape every instrumentation's layout is
read into, and the `transitions` schema in `nightshift.schemas`. Still to come:
per-convention readers, trajectories, rewards, credit assignment, `nightshift build`.
"""
