"""`nightshift route`: a canary routing proxy in front of vLLM, off by default.

Agents point their base URL at it instead of at vLLM (`OPENAI_BASE_URL=
http://127.0.0.1:8100/v1`: configuration, not code). A request whose body's
`model` is a stable name in the route table (`agent`) is sent to the route's
serving version (`agent@v0003`) or its candidate (`agent@v0004`) by a weighted
choice that is sticky per conversation (`choose.py`), with only the body's
`model` rewritten; vLLM then answers with the versioned name, which the logged
calls record as the version that made them. Everything else (the base model, a
versioned name asked for directly) passes through untouched, byte for byte.
Responses come back verbatim, streams chunk by chunk (`proxy.py`).

It is a trust boundary: only the inference API passes (`paths.py`: chat
completions, completions, responses, embeddings, models), matched on the path as
vLLM's router reads it; vLLM's admin API (LoRA loading, collective_rpc, sleep...)
is refused, as is every other path, without the upstream hearing of it. Only the
headers the upstream needs go on (`headers.py`), the body is passed on byte for
byte but for its `model`'s value (`rewrite.py`), and an https upstream is spoken
to over verified TLS (`upstream.py`). docs/RELIABILITY.md has the trust model.

Control API (`control.py`; `client.py` is its Python client), guarded by
`Authorization: Bearer <route.admin_token>` when one is set, and answered only
for a Host this proxy goes by (loopback names, IP addresses, its listen host,
`route.allowed_hosts`), never for a browser's cross-origin request:

    GET    /nightshift/routes                 every route, the versions found missing, the upstream
    PUT    /nightshift/routes/agent           {"serving": "agent@v0003", "candidate": "agent@v0004", "share": 0.1}
    PUT    /nightshift/routes/agent           {"serving": "agent@v0004"}      promote: all traffic to one version
    DELETE /nightshift/routes/agent           requests for `agent` pass through again

A change is checked, written to the state file and fsync'd, and logged before
the 200; the table is read back at start. For canary publishing, the nightly job
publishes the candidate under its versioned name (beside the serving one), then
PUTs the route with the share; the watch promotes (PUT serving = the candidate)
or rolls back (PUT serving = the previous version, no candidate). Several proxies
in front of one vLLM each keep their own table: PUT to each.

Prompt routes (`prompt.py`, issue 27) make the same sticky choice for a system
prompt: `PUT /nightshift/routes/prompt:<the agent's system id>` with `{"kind":
"prompt", "candidate", "system", "share"}` puts a stored candidate's text (checked
against its id) in place of the leading system messages of that share of the
conversations whose prompt has that id, in the raw bytes, and marks their answers'
`model` `+p:<version>` (`mark.py`) so the build attributes each call to the prompt
the model saw. docs/prompts.md has the rules.

Also on the proxy: `GET /healthz`, `GET /metrics` (Prometheus, `metrics.py`),
one log line per decision. Modules: `config.py` (settings), `table.py`,
`choose.py`, `paths.py`, `headers.py`, `rewrite.py`, `prompt.py`, `mark.py`, `proxy.py`, `upstream.py`,
`control.py`, `client.py`, `metrics.py`, `server.py`.
"""
