"""Prompts learn too: the prompt versions an agent used, read from the lake, and
automatic prompt optimization (APO) that proposes edited versions of them.

For an agent on a hosted model no one can train the weights of; its prompt is the
only thing that can learn. This stage reads which system prompts and tools each
agent called with (`versions`: one content hash per prompt, per-request data
folded into a template first: `schemas/prompt_template.py`, `prompt_identity.py`,
in schemas/ because the route computes the same id from one request), how each
did in production, and has an OpenAI-compatible LLM critique the failures and propose
edited prompts (`propose`), stored versioned like checkpoints (`store`), checked
before anyone sees them (`validate`), optionally screened by the user's own
evaluation command (judge/screen.py, handed in by the caller), the good ones carried as next night's parents
(`beam`).
"""
