"""Judge: is a version, adapter or prompt, good enough for the agents?

gate (offline: held-out scoring of a candidate against what is served, and the
user's evaluation command: may it go out?) with gatelog (what the gate said, kept)
-> versions (production reward of every version served) -> watch (online: an
always-valid sequential test of what serves, or of a canary, against what served
before, then the rollback, the stop or the promotion, done through publish/).
Judging imports publish/, never the other way: publish/ only puts versions in
front of agents and does not need to know why.
"""
