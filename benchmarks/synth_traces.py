"""Synthetic agent trajectories, written as a `spans` dataset or built one by one.

Used by `benchmarks/transform.py` (Parquet, vectorized) and `benchmarks/peer_agl.py`
(the same trajectories as Agent Lightning `Span` objects, in its own virtualenv).
Importing this module needs only the standard library; numpy and pyarrow are
imported by the Parquet writer alone.

The shape follows `shared/research/agent-lightning-bench/bench.py`, so both sides
see like-for-like work. Each trajectory is one trace:

    rollout.session                      root
    ├── agent.run  (agent.name=writer)   the agent
    │   ├── openai.chat.completion  x K  LLM calls (K = Params.calls)
    └── agentlightning.annotation        reward: agentlightning.reward.0.{name,value}

LLM calls carry a system and a user message (`prompt_chars` long), the completion
(`response_chars`), usage, and token ids as OTLP int arrays: the prompt starts at
`prompt_tokens` ids and grows by `prompt_step` per turn (the previous prompt, the
previous response, then new ids), the response has `response_tokens` ids. With
`mix`, a third of the traces each use OpenLLMetry's pre-0.55 layout plus token ids
(what Agent Lightning 0.x reads), OpenInference, or the OpenTelemetry GenAI JSON
attributes (for those two, the agent span uses the same convention too).
Trajectories come in groups of `attempts` that share their first user message (the
same task, several rollouts), as in RL training.

Every value is a pure function of (seed, trajectory index, field): a splitmix64
hash computed the same way on Python ints and on numpy uint64 arrays, plus two
pools (text, token ids) made once from the seed. Both renderers below read one
table of span layouts (`_layout`), so the Parquet rows and the `Span` objects
hold the same values by construction (tests/test_bench_synth.py checks it).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import random
import sys
from array import array
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

M64 = (1 << 64) - 1
DAY_NS = 86_400 * 10**9
SEC = 10**9

CONVENTIONS = ("agentlightning", "openinference", "otel_genai")
AGL, OPENINFERENCE, GENAI = range(3)

SERVICES = ("writer-agent", "support-agent", "research-agent", "code-agent")
MODELS = ("Qwen2.5-1.5B-Instruct", "Qwen2.5-7B-Instruct", "Llama-3.1-8B-Instruct")
# ASCII without quotes or backslashes: pieces are pasted into JSON text unescaped.
SYSTEM_PROMPTS = (
    "You are a helpful agent.",
    "You are a careful writer. Answer in plain words and keep it short.",
    "You are a research assistant. Cite the source of every claim and say when you are unsure.",
    "You are a coding assistant. Prefer small, tested changes and explain the reasoning step by step.",
)
WORDS = (
    "the a an and or but if then else when while for with without about into over under between "
    "customer order invoice refund shipment account balance payment subscription plan renewal "
    "please summarize explain compare list extract classify translate rewrite draft review check "
    "quarterly revenue forecast variance region product team meeting notes action items owner "
    "deadline priority status blocked pending resolved escalated ticket incident outage latency "
    "database query index table column schema migration rollback deploy release version build "
    "function class method argument return value error exception retry timeout cache memory "
    "user assistant system tool result context window token budget answer question reason step "
    "first second third finally however therefore because since although unless until before after "
    "report chart graph trend increase decrease percent total average median maximum minimum "
    "is are was were be been has have had do does did can could should would will may might must "
    "this that these those it its they their we our you your he she his her them us"
).split()
VOCAB = 32_000  # token ids are drawn from [0, VOCAB)
TEXT_POOL_CHARS = 4 << 20
TOKEN_POOL_MIN = 1 << 20


@dataclass(frozen=True)
class Params:
    spans: int = 1_000_000  # rounded down to whole trajectories (at least one)
    calls: int = 5  # LLM calls per trajectory (K)
    prompt_chars: int = 2000  # user message
    response_chars: int = 300  # completion text
    prompt_tokens: int = 300  # prompt token ids of the first call
    prompt_step: int = 200  # ... growth per call
    response_tokens: int = 100
    attempts: int = 4  # trajectories per task (same first user message)
    days: int = 3  # date partitions
    start_date: str = "2026-11-01"
    mix: bool = False
    seed: int = 0

    @property
    def spans_per_trajectory(self) -> int:
        return self.calls + 3

    @property
    def trajectories(self) -> int:
        return max(1, self.spans // self.spans_per_trajectory)

    @property
    def total_spans(self) -> int:
        return self.trajectories * self.spans_per_trajectory

    @property
    def llm_spans(self) -> int:
        return self.trajectories * self.calls

    @property
    def max_tokens(self) -> int:
        """Token ids one trajectory spans in the pool: last prompt + last response."""
        return self.prompt_tokens + (self.calls - 1) * self.prompt_step + self.response_tokens

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Params":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    def check(self) -> None:
        if self.calls < 1 or self.attempts < 1 or self.days < 1:
            raise ValueError("calls, attempts and days must be >= 1")
        if min(self.prompt_chars, self.response_chars, self.prompt_tokens, self.prompt_step, self.response_tokens) < 0:
            raise ValueError("sizes must be >= 0")
        if max(self.prompt_chars, self.response_chars) > TEXT_POOL_CHARS // 2:
            raise ValueError(f"prompt_chars/response_chars must be <= {TEXT_POOL_CHARS // 2}")
        dt.date.fromisoformat(self.start_date)


#: The flags that shape a trajectory, as `Params` names them: benchmarks/transform.py
#: and its peer, benchmarks/peer_agl.py, take the same ones, so the peer can be run
#: alone on the trajectories transform.py writes.
SHAPE_FLAGS = {
    "calls": "LLM calls per trajectory",
    "prompt_chars": "user message length",
    "response_chars": "completion length",
    "prompt_tokens": "prompt token ids of the first call",
    "prompt_step": "prompt growth per call, in token ids",
    "response_tokens": "response token ids per call",
    "attempts": "trajectories per task, sharing the first user message",
}


def add_shape_flags(ap) -> None:
    """`--calls`, `--prompt-chars`, ... on an argparse parser, defaults from Params."""
    d = Params()
    for name, what in SHAPE_FLAGS.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name),
                        help=f"{what} (default {getattr(d, name)})")


def shape_of(args) -> dict:
    """The shape flags' values from parsed arguments, as Params fields."""
    return {name: getattr(args, name) for name in SHAPE_FLAGS}


# --------------------------------------------------------------------------------------
# Hashing: the same arithmetic on Python ints and numpy uint64 arrays
# --------------------------------------------------------------------------------------

_G1 = 0x9E3779B97F4A7C15
_G2 = 0xD1B54A32D192ED03


def _fmix(x):
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def _h(key: int, i, f):
    """64 random bits for (seed key, index i, field f); i and f: ints or uint64 arrays."""
    if isinstance(f, int):
        f = (f * _G2) & M64
    else:
        f = f * _G2  # numpy uint64: wraps
    if isinstance(i, int):
        return _fmix((key + i * _G1 + f) & M64)
    return _fmix(i * _G1 + key + f)


def _mod(x, n: int):
    if isinstance(x, int):
        return x % n
    import numpy as np

    return (x % np.uint64(n)).astype(np.int64)


# Field ids (per trajectory), and bases for per-call fields (+ j).
F_CONV, F_T0, F_SVC, F_MODEL, F_SYS, F_REWARD, F_TOK, F_TRACE_HI, F_TRACE_LO, F_TASK_USER = range(1, 11)
F_SPAN = 1 << 8  # + span position in the trajectory
F_USER = 2 << 8  # + j
F_RESP = 3 << 8
F_RID = 4 << 8


# --------------------------------------------------------------------------------------
# Pools
# --------------------------------------------------------------------------------------


class Pools:
    """Text and token ids every value is cut from (made once per seed)."""

    def __init__(self, seed: int, token_pool: int):
        rng = random.Random(f"nightshift-synth-{seed}")
        words = rng.choices(WORDS, k=TEXT_POOL_CHARS // 5)
        text = " ".join(words)[:TEXT_POOL_CHARS]
        self.text = text
        raw = array("H")
        raw.frombytes(rng.randbytes(2 * token_pool))
        if sys.byteorder == "big":
            raw.byteswap()
        self.tokens = [v % VOCAB for v in raw]
        strs = list(map(str, self.tokens))
        self.tok_json = ",".join(strs) + ","  # token k at cp[k]; every id followed by a comma
        self.cp = list(accumulate(map((1).__add__, map(len, strs)), initial=0))
        self._np = None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def numpy(self):
        """(text bytes, token JSON bytes, char positions) as numpy arrays, padded with
        16 zero bytes so fixed-width gathers near the end stay in range."""
        if self._np is None:
            import numpy as np

            pad = b"\0" * 16
            self._np = (np.frombuffer(self.text.encode("ascii") + pad, np.uint8),
                        np.frombuffer(self.tok_json.encode("ascii") + pad, np.uint8),
                        np.asarray(self.cp, np.int64))
        return self._np


@lru_cache(maxsize=4)
def pools_for(seed: int, token_pool: int) -> Pools:
    return Pools(seed, token_pool)


def pools(p: Params) -> Pools:
    return pools_for(p.seed, max(TOKEN_POOL_MIN, 4 * p.max_tokens))


# --------------------------------------------------------------------------------------
# Values: strings are concatenations of pieces, so the vectorized writer can point
# into the pools instead of building Python strings
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pick:
    options: tuple
    idx: object  # int or int64 array


@dataclass(frozen=True)
class Text:
    off: object
    n: int


@dataclass(frozen=True)
class Tok:
    """Token ids [a, a+n) of the pool, as JSON without the brackets."""

    a: object
    n: int


@dataclass(frozen=True)
class Hex:
    x: object  # uint64
    width: int = 16


class S:
    """A string attribute (or column) value: pieces (str constants, Pick, Text, Tok, Hex)."""

    __slots__ = ("pieces",)
    type = "string"

    def __init__(self, *pieces):
        self.pieces = pieces


class A(S):
    """An array attribute, kept as JSON text in value.json_value."""

    __slots__ = ()
    type = "array"


class I:  # noqa: E742
    __slots__ = ("x",)
    type = "int"

    def __init__(self, x):
        self.x = x


class D(I):
    __slots__ = ()
    type = "double"


def _tokens(a, n: int) -> A:
    return A("[", Tok(a, n), "]")


# --------------------------------------------------------------------------------------
# The trajectories
# --------------------------------------------------------------------------------------


class Ctx:
    """Per-trajectory (and, for LLM spans, per-call) fields. Attributes are ints for
    one span, numpy arrays for a group of spans."""


def _base_ns(p: Params) -> int:
    d = dt.date.fromisoformat(p.start_date)
    return int(dt.datetime(d.year, d.month, d.day, tzinfo=dt.timezone.utc).timestamp()) * SEC


def convention_of(p: Params, i):
    """0 (Agent Lightning's layout) for every trace unless `mix`."""
    if not p.mix:
        return 0
    return _mod(_h(_key(p), i, F_CONV), len(CONVENTIONS))


def _key(p: Params) -> int:
    return _fmix((p.seed * _G2 + 0x5EED) & M64)


def day_of(p: Params, i):
    """Trajectories are spread over `days` dates in contiguous blocks."""
    return (i * p.days) // p.trajectories


def day_start(p: Params, d: int) -> int:
    """The first trajectory of date d."""
    n, k = p.trajectories, p.days
    return -((-d * n) // k)


def _ctx(p: Params, i, pool: Pools) -> Ctx:
    """Trajectory fields; i: int or uint64 array."""
    key = _key(p)
    c = Ctx()
    vec = not isinstance(i, int)
    if vec:
        import numpy as np

        ii = i.astype(np.int64)
    else:
        ii = i
    c.i, c.i_u = ii, i
    c.conv = convention_of(p, i)
    c.day = day_of(p, ii)
    c.t0 = _base_ns(p) + c.day * DAY_NS + _mod(_h(key, i, F_T0), 23 * 3600 * 1000) * 1_000_000
    c.svc = _mod(_h(key, i, F_SVC), len(SERVICES))
    c.model = _mod(_h(key, i, F_MODEL), len(MODELS))
    c.sysp = _mod(_h(key, i, F_SYS), len(SYSTEM_PROMPTS))
    r = _h(key, i, F_REWARD) & 1
    c.reward = float(r) if not vec else r.astype(np.float64)
    c.tok = _mod(_h(key, i, F_TOK), pool.n_tokens - p.max_tokens + 1)
    c.trace_hi = _h(key, i, F_TRACE_HI)
    c.trace_lo = _h(key, i, F_TRACE_LO)
    task = ii // p.attempts
    task_u = task if not vec else task.astype(np.uint64)
    c.task_user_off = _mod(_h(key, task_u, F_TASK_USER), len(pool.text) - p.prompt_chars + 1)
    c.key = key
    return c


def _call_ctx(p: Params, c: Ctx, j, pool: Pools) -> Ctx:
    """Add call j's fields to trajectory fields c (same shapes)."""
    key = c.key
    vec = not isinstance(j, int)
    if vec:
        import numpy as np

        ju = j.astype(np.uint64)
    else:
        ju = j
    c.j = j
    user = _mod(_h(key, c.i_u, F_USER + ju), len(pool.text) - p.prompt_chars + 1)
    if vec:
        import numpy as np

        c.user_off = np.where(j == 0, c.task_user_off, user)
    else:
        c.user_off = c.task_user_off if j == 0 else user
    c.resp_off = _mod(_h(key, c.i_u, F_RESP + ju), len(pool.text) - p.response_chars + 1)
    c.rid = _h(key, c.i_u, F_RID + ju)
    c.ptoks = p.prompt_tokens + j * p.prompt_step
    c.st = c.t0 + SEC + j * 8 * SEC
    c.et = c.st + 7 * SEC
    return c


@dataclass
class SpanLayout:
    name: S
    kind: str
    status: str
    scope: tuple  # (name, version)
    start: object
    end: object
    attrs: list  # [(key, S | A | I | D)]


ROLE_ROOT, ROLE_AGENT, ROLE_LLM, ROLE_REWARD = range(4)


def _layout(p: Params, conv: int, role: int, c: Ctx) -> SpanLayout:
    """The one description of every span both renderers read."""
    if role == ROLE_ROOT:
        return SpanLayout(S("rollout.session"), "internal", "unset", ("agentlightning", "0.3.0"),
                          c.t0, c.t0 + 50 * SEC, [])
    if role == ROLE_REWARD:
        return SpanLayout(S("agentlightning.annotation"), "internal", "ok", ("agentlightning", "0.3.0"),
                          c.t0 + 46 * SEC, c.t0 + 46 * SEC + 1_000_000,
                          [("agentlightning.reward.0.name", S("primary")), ("agentlightning.reward.0.value", D(c.reward))])
    if role == ROLE_AGENT:
        start, end = c.t0 + SEC // 2, c.t0 + 45 * SEC
        if conv == GENAI:
            return SpanLayout(S("invoke_agent writer"), "internal", "unset", ("openai-agents", "0.4.0"), start, end,
                              [("gen_ai.operation.name", S("invoke_agent")), ("gen_ai.agent.name", S("writer"))])
        if conv == OPENINFERENCE:
            return SpanLayout(S("writer"), "internal", "unset", ("openinference.instrumentation.openai_agents", "1.2.0"),
                              start, end, [("openinference.span.kind", S("AGENT")), ("agent.name", S("writer"))])
        return SpanLayout(S("agent.run"), "internal", "unset", ("agentlightning", "0.3.0"), start, end,
                          [("agent.name", S("writer"))])
    # LLM call
    model = Pick(MODELS, c.model)
    system = Pick(SYSTEM_PROMPTS, c.sysp)
    user = Text(c.user_off, p.prompt_chars)
    answer = Text(c.resp_off, p.response_chars)
    rid = S("chatcmpl-", Hex(c.rid))
    if conv == GENAI:
        return SpanLayout(S("chat ", model), "client", "unset", ("opentelemetry.instrumentation.openai_v2", "2.1b0"),
                          c.st, c.et, [
                              ("gen_ai.operation.name", S("chat")),
                              ("gen_ai.provider.name", S("openai")),
                              ("gen_ai.request.model", S(model)),
                              ("gen_ai.request.temperature", D(0.7)),
                              ("gen_ai.response.id", rid),
                              ("gen_ai.response.model", S(model)),
                              ("gen_ai.response.finish_reasons", A('["stop"]')),
                              ("gen_ai.usage.input_tokens", I(c.ptoks)),
                              ("gen_ai.usage.output_tokens", I(p.response_tokens)),
                              ("gen_ai.input.messages", S('[{"role":"system","parts":[{"type":"text","content":"', system,
                                                          '"}]},{"role":"user","parts":[{"type":"text","content":"', user,
                                                          '"}]}]')),
                              ("gen_ai.output.messages", S('[{"role":"assistant","parts":[{"type":"text","content":"', answer,
                                                           '"}],"finish_reason":"stop"}]')),
                          ])
    if conv == OPENINFERENCE:
        return SpanLayout(S("ChatCompletion"), "internal", "unset", ("openinference.instrumentation.openai", "0.1.30"),
                          c.st, c.et, [
                              ("openinference.span.kind", S("LLM")),
                              ("llm.system", S("openai")),
                              ("llm.provider", S("openai")),
                              ("llm.model_name", S(model)),
                              ("llm.invocation_parameters", S('{"model": "', model, '", "temperature": 0.7}')),
                              ("llm.input_messages.0.message.role", S("system")),
                              ("llm.input_messages.0.message.content", S(system)),
                              ("llm.input_messages.1.message.role", S("user")),
                              ("llm.input_messages.1.message.content", S(user)),
                              ("llm.output_messages.0.message.role", S("assistant")),
                              ("llm.output_messages.0.message.content", S(answer)),
                              ("llm.token_count.prompt", I(c.ptoks)),
                              ("llm.token_count.completion", I(p.response_tokens)),
                              ("llm.token_count.total", I(c.ptoks + p.response_tokens)),
                          ])
    # OpenLLMetry before 0.55 (AgentOps / Agent Lightning 0.x), plus Agent Lightning's token ids
    return SpanLayout(S("openai.chat.completion"), "client", "unset", ("opentelemetry.instrumentation.openai.v1", "0.40.0"),
                      c.st, c.et, [
                          ("gen_ai.system", S("openai")),
                          ("gen_ai.request.model", S(model)),
                          ("gen_ai.request.temperature", D(0.7)),
                          ("llm.request.type", S("chat")),
                          ("gen_ai.prompt.0.role", S("system")),
                          ("gen_ai.prompt.0.content", S(system)),
                          ("gen_ai.prompt.1.role", S("user")),
                          ("gen_ai.prompt.1.content", S(user)),
                          ("gen_ai.completion.0.role", S("assistant")),
                          ("gen_ai.completion.0.content", S(answer)),
                          ("gen_ai.completion.0.finish_reason", S("stop")),
                          ("gen_ai.response.id", rid),
                          ("gen_ai.response.model", S(model)),
                          ("gen_ai.usage.prompt_tokens", I(c.ptoks)),
                          ("gen_ai.usage.completion_tokens", I(p.response_tokens)),
                          ("prompt_token_ids", _tokens(c.tok, c.ptoks)),
                          ("response_token_ids", _tokens(c.tok + c.ptoks, p.response_tokens)),
                      ])


def _roles(p: Params) -> list[tuple[int, int, int | None]]:
    """(role, call index, parent position) for each span position of a trajectory."""
    out = [(ROLE_ROOT, -1, None), (ROLE_AGENT, -1, 0)]
    out += [(ROLE_LLM, j, 1) for j in range(p.calls)]
    out.append((ROLE_REWARD, -1, 0))
    return out


RESOURCE_EXTRA = (("service.version", "1.4.2"), ("deployment.environment.name", "training"),
                  ("telemetry.sdk.name", "opentelemetry"), ("telemetry.sdk.language", "python"),
                  ("telemetry.sdk.version", "1.38.0"))


def resource_attributes(service: str) -> list[tuple[str, str]]:
    return [("service.name", service), *RESOURCE_EXTRA]


PROMOTED = {  # = nightshift.schemas.spans.PROMOTED (checked by the test; no nightshift import here)
    "gen_ai_operation_name": ("gen_ai.operation.name",),
    "gen_ai_provider_name": ("gen_ai.provider.name", "gen_ai.system"),
    "gen_ai_request_model": ("gen_ai.request.model",),
    "gen_ai_response_model": ("gen_ai.response.model",),
    "gen_ai_agent_name": ("gen_ai.agent.name",),
    "gen_ai_conversation_id": ("gen_ai.conversation.id",),
}


def _promoted(attrs: list) -> dict:
    """column -> the S value it takes (first listed key present as a string), or None."""
    out = {}
    for col, names in PROMOTED.items():
        out[col] = None
        for name in names:
            v = next((v for k, v in attrs if k == name and v.type == "string"), None)
            if v is not None:
                out[col] = v
                break
    return out


# --------------------------------------------------------------------------------------
# Scalar renderer: one trajectory as plain dicts (for Agent Lightning and the tests)
# --------------------------------------------------------------------------------------


def _str(v: S, pool: Pools) -> str:
    out = []
    for piece in v.pieces:
        if isinstance(piece, str):
            out.append(piece)
        elif isinstance(piece, Pick):
            out.append(piece.options[piece.idx])
        elif isinstance(piece, Text):
            out.append(pool.text[piece.off:piece.off + piece.n])
        elif isinstance(piece, Tok):
            if piece.n > 0:
                out.append(pool.tok_json[pool.cp[piece.a]:pool.cp[piece.a + piece.n] - 1])
        elif isinstance(piece, Hex):
            out.append(format(piece.x, "016x")[16 - piece.width:])
        else:
            raise TypeError(piece)
    return "".join(out)


def _value(v, pool: Pools):
    if isinstance(v, A):
        return json.loads(_str(v, pool))
    if isinstance(v, S):
        return _str(v, pool)
    if isinstance(v, D):
        return float(v.x)
    return int(v.x)


def trajectory(p: Params, i: int) -> list[dict]:
    """Trajectory i as span dicts: ids (hex), name, kind, status_code, start_ns, end_ns,
    received_ns, service_name, scope_name, scope_version, convention, promoted
    columns, and `attributes`: [(key, type, value)] with arrays as Python lists."""
    pool = pools(p)
    c = _ctx(p, i, pool)
    conv = c.conv
    trace_id = format(c.trace_hi, "016x") + format(c.trace_lo, "016x")
    roles = _roles(p)
    sids = [format(_h(c.key, i, F_SPAN + pos), "016x") for pos in range(len(roles))]
    out = []
    for pos, (role, j, parent) in enumerate(roles):
        if role == ROLE_LLM:
            _call_ctx(p, c, j, pool)
        lay = _layout(p, conv, role, c)
        d = {
            "trace_id": trace_id,
            "span_id": sids[pos],
            "parent_span_id": sids[parent] if parent is not None else None,
            "name": _str(lay.name, pool),
            "kind": lay.kind,
            "status_code": lay.status,
            "start_ns": int(lay.start),
            "end_ns": int(lay.end),
            "received_ns": int(lay.end) + SEC,
            "service_name": SERVICES[c.svc],
            "scope_name": lay.scope[0],
            "scope_version": lay.scope[1],
            "convention": CONVENTIONS[conv],
            "attributes": [(k, v.type, _value(v, pool)) for k, v in lay.attrs],
        }
        for col, v in _promoted(lay.attrs).items():
            d[col] = _str(v, pool) if v is not None else None
        out.append(d)
    return out


def date_of_trajectory(p: Params, i: int) -> str:
    return (dt.date.fromisoformat(p.start_date) + dt.timedelta(days=day_of(p, i))).isoformat()


# --------------------------------------------------------------------------------------
# Vectorized renderer: a range of trajectories as one Arrow table of the spans schema
# --------------------------------------------------------------------------------------


class _Buffers:
    """The byte buffers string views point into: constants, text pool, token JSON
    pool, and the hex digits rendered for this chunk."""

    CONST, TEXT, TOK, HEX = range(4)

    def __init__(self, pool: Pools):
        import numpy as np

        self.np = np
        self.text, self.tok, self.cp = pool.numpy()
        self.const = bytearray()
        self.const_off: dict[str, int] = {}
        self.hex_parts: list = []
        self.hex_len = 0
        self._frozen = None
        self._flat = None

    def const_at(self, s: str) -> tuple[int, int]:
        off = self.const_off.get(s)
        b = s.encode()
        if off is None:
            off = self.const_off[s] = len(self.const)
            self.const += b
        return off, len(b)

    def piece(self, piece, m: int):
        """(buffer, offset, length), scalars or arrays of m."""
        np = self.np
        if isinstance(piece, str):
            off, n = self.const_at(piece)
            return self.CONST, off, n
        if isinstance(piece, Pick):
            at = [self.const_at(o) for o in piece.options]
            offs = np.asarray([a for a, _ in at], np.int64)
            lens = np.asarray([n for _, n in at], np.int64)
            return self.CONST, offs[piece.idx], lens[piece.idx]
        if isinstance(piece, Text):
            return self.TEXT, piece.off, piece.n
        if isinstance(piece, Tok):
            start = self.cp[piece.a]
            return self.TOK, start, np.maximum(self.cp[piece.a + piece.n] - 1 - start, 0)
        if isinstance(piece, Hex):
            x = np.broadcast_to(np.asarray(piece.x, np.uint64), (m,))
            b = x.astype(">u8").view(np.uint8).reshape(m, 8)
            digits = np.stack([b >> 4, b & 15], axis=-1).reshape(m, 16)
            self.hex_parts.append(_HEX_CHARS[digits].ravel())
            base = self.hex_len
            self.hex_len += 16 * m
            return self.HEX, base + np.arange(m, dtype=np.int64) * 16 + (16 - piece.width), piece.width
        raise TypeError(piece)

    def frozen(self) -> list:
        """The buffers as numpy uint8 arrays (padded), once every piece is placed."""
        np = self.np
        if self._frozen is None or self._frozen_at != (len(self.const), self.hex_len):
            self._frozen_at = (len(self.const), self.hex_len)
            self._flat = None
            pad = np.zeros(16, np.uint8)
            const = np.concatenate([np.frombuffer(bytes(self.const), np.uint8), pad])
            hexes = np.concatenate([*self.hex_parts, pad])
            self._frozen = [const, self.text, self.tok, hexes]
        return self._frozen

    def flat(self):
        """All buffers end to end, and where each starts: one gather for every view."""
        np = self.np
        bufs = self.frozen()
        if self._flat is None:
            base = np.cumsum([0] + [len(b) for b in bufs[:-1]]).astype(np.int64)
            self._flat = (np.concatenate(bufs), base)
        return self._flat


_HEX_CHARS = None


class _Strings:
    """A string column whose values are concatenations of pieces.

    Values that are one constant (a str or a Pick) are kept as codes into a small
    table and expanded by an Arrow `take`; the others are built as string views into
    the buffers (no Python strings) and cast to plain strings by Arrow, one array per
    piece position, joined at the end."""

    def __init__(self, n: int, bufs: _Buffers):
        self.n, self.bufs, self.np = n, bufs, bufs.np
        self.parts: list = []  # per piece position: (buffer, offset, length) arrays
        self.codes = None  # int32, -1: not a constant
        self.table: dict[str, int] = {}
        self.valid = None

    def _code(self, s: str) -> int:
        return self.table.setdefault(s, len(self.table))

    def put(self, rows, value) -> None:
        np = self.np
        if value is None:
            if self.valid is None:
                self.valid = np.ones(self.n, bool)
            self.valid[rows] = False
            return
        pieces = value.pieces
        if len(pieces) == 1 and isinstance(pieces[0], (str, Pick)):
            if self.codes is None:
                self.codes = np.full(self.n, -1, np.int32)
            piece = pieces[0]
            if isinstance(piece, str):
                self.codes[rows] = self._code(piece)
            else:
                self.codes[rows] = np.asarray([self._code(o) for o in piece.options], np.int32)[piece.idx]
            return
        m = len(rows) if not isinstance(rows, slice) else len(range(*rows.indices(self.n)))
        for q, piece in enumerate(pieces):
            while len(self.parts) <= q:
                self.parts.append((np.zeros(self.n, np.int32), np.zeros(self.n, np.int64), np.zeros(self.n, np.int64)))
            b, o, ln = self.bufs.piece(piece, m)
            B, O, L = self.parts[q]
            B[rows], O[rows], L[rows] = b, o, ln

    def array(self):
        import pyarrow as pa
        import pyarrow.compute as pc

        np = self.np
        validity = None
        if self.valid is not None:
            validity = pa.py_buffer(np.packbits(self.valid, bitorder="little"))
        if not self.parts:
            if self.codes is None:
                return pa.nulls(self.n, pa.string())
            codes = self.codes
            mask = codes < 0
            return pa.array(list(self.table), pa.string()).take(pa.array(codes, pa.int32(), mask=mask if mask.any() else None))
        if self.codes is not None:  # constants among pieced values: point them at the constant buffer
            rows = np.flatnonzero(self.codes >= 0)
            at = [self.bufs.const_at(s) for s in self.table]
            offs = np.asarray([a for a, _ in at], np.int64)
            lens = np.asarray([n for _, n in at], np.int64)
            B, O, L = self.parts[0]
            B[rows], O[rows], L[rows] = _Buffers.CONST, offs[self.codes[rows]], lens[self.codes[rows]]
            for B, O, L in self.parts[1:]:
                L[rows] = 0
        bufs = self.bufs.frozen()
        flat, base = self.bufs.flat()
        ar12 = np.arange(12)
        arrays = []
        for q, (B, O, L) in enumerate(self.parts):
            views = np.zeros((self.n, 16), np.uint8)
            v32 = views.view(np.int32)
            v32[:, 0] = L
            got = flat[(base[B] + O)[:, None] + ar12]
            short = L <= 12
            got[short[:, None] & (ar12[None, :] >= L[:, None])] = 0
            views[:, 4:16] = got
            long_ = np.flatnonzero(~short)
            v32[long_, 2] = B[long_]
            v32[long_, 3] = O[long_]
            sv = pa.Array.from_buffers(pa.string_view(), self.n,
                                       [validity if q == 0 else None, pa.py_buffer(views), *map(pa.py_buffer, bufs)])
            arrays.append(sv.cast(pa.string()))
        if len(arrays) == 1:
            return arrays[0]
        return pc.binary_join_element_wise(*arrays, "")


def _expand(compact, valid):
    """A string array of len(valid) holding `compact`'s values (no nulls) where valid
    is true, nulls elsewhere, without copying the character data."""
    import numpy as np
    import pyarrow as pa

    n = len(valid)
    if len(compact) == 0:
        return pa.nulls(n, pa.string())
    compact = pa.concat_arrays([compact]) if compact.offset else compact
    _, offs, data = compact.buffers()
    co = np.frombuffer(offs, np.int32, len(compact) + 1)
    lengths = np.zeros(n, np.int64)
    lengths[valid] = np.diff(co)
    fo = np.empty(n + 1, np.int32)
    fo[0] = co[0]
    np.cumsum(lengths, out=fo[1:].view(np.int32), dtype=np.int32)
    fo[1:] += co[0]
    return pa.Array.from_buffers(pa.string(), n, [pa.py_buffer(np.packbits(valid, bitorder="little")),
                                                 pa.py_buffer(fo), data], null_count=int(n - valid.sum()))


def chunk_table(p: Params, a: int, b: int):
    """Trajectories [a, b) as a pyarrow Table of the spans schema (schema metadata
    included), rows trajectory by trajectory in span-position order."""
    global _HEX_CHARS
    import numpy as np
    import pyarrow as pa

    schema = _spans_schema()
    if _HEX_CHARS is None:
        _HEX_CHARS = np.frombuffer(b"0123456789abcdef", np.uint8)
    pool = pools(p)
    bufs = _Buffers(pool)
    roles = _roles(p)
    spt = len(roles)
    nt = b - a
    n = nt * spt
    i_all = np.arange(a, b, dtype=np.uint64)
    base = _ctx(p, i_all, pool)
    conv_all = np.asarray(base.conv, np.int64) if p.mix else np.zeros(nt, np.int64)

    cols = {name: _Strings(n, bufs) for name in ("trace_id", "span_id", "parent_span_id", "name", "kind", "status_code",
                                                 "service_name", "scope_name", "scope_version", *PROMOTED)}
    start = np.zeros(n, np.int64)
    end = np.zeros(n, np.int64)
    # trajectory-level columns
    rep = lambda x: np.repeat(x, spt)  # noqa: E731
    cols["trace_id"].put(slice(None), S(Hex(rep(base.trace_hi)), Hex(rep(base.trace_lo))))
    cols["service_name"].put(slice(None), S(Pick(SERVICES, rep(base.svc))))
    sids = [_h(base.key, i_all, F_SPAN + pos) for pos in range(spt)]

    groups = []  # (rows, layout)
    for conv in sorted(set(conv_all.tolist())):
        t = np.flatnonzero(conv_all == conv)
        sub = _subset(base, t)
        for pos, (role, j, parent) in enumerate(roles):
            if role == ROLE_LLM and j > 0:
                continue  # all calls done together at j == 0
            if role == ROLE_LLM:
                k = p.calls
                rows = (t[:, None] * spt + pos + np.arange(k)[None, :]).ravel()
                c = _subset(sub, np.repeat(np.arange(len(t)), k))
                _call_ctx(p, c, np.tile(np.arange(k, dtype=np.int64), len(t)), pool)
                span_ids = np.stack([sids[pos + jj][t] for jj in range(k)], axis=1).ravel()
                parent_ids = np.repeat(sids[parent][t], k)
            else:
                rows = t * spt + pos
                c = sub
                span_ids = sids[pos][t]
                parent_ids = sids[parent][t] if parent is not None else None
            lay = _layout(p, conv, role, c)
            cols["span_id"].put(rows, S(Hex(span_ids)))
            cols["parent_span_id"].put(rows, S(Hex(parent_ids)) if parent_ids is not None else None)
            cols["name"].put(rows, lay.name)
            cols["kind"].put(rows, S(lay.kind))
            cols["status_code"].put(rows, S(lay.status))
            cols["scope_name"].put(rows, S(lay.scope[0]))
            cols["scope_version"].put(rows, S(lay.scope[1]))
            for col, v in _promoted(lay.attrs).items():
                cols[col].put(rows, v)
            start[rows] = lay.start
            end[rows] = lay.end
            groups.append((rows, lay))

    # attributes: entries in row order
    n_attr = np.zeros(n, np.int64)
    for rows, lay in groups:
        n_attr[rows] = len(lay.attrs)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(n_attr, out=offsets[1:])
    e = int(offsets[-1])
    keys, types = _Strings(e, bufs), _Strings(e, bufs)
    ivals = np.zeros(e, np.int64)
    ivalid = np.zeros(e, bool)
    dvals = np.zeros(e, np.float64)
    dvalid = np.zeros(e, bool)
    svalid = np.zeros(e, bool)
    jvalid = np.zeros(e, bool)
    placed = []  # (dest, value) of string and array values
    for rows, lay in groups:
        first = offsets[rows]
        for k, (key, v) in enumerate(lay.attrs):
            dest = first + k
            keys.put(dest, S(key))
            types.put(dest, S(v.type))
            if isinstance(v, A):
                jvalid[dest] = True
                placed.append((dest, v))
            elif isinstance(v, S):
                svalid[dest] = True
                placed.append((dest, v))
            elif isinstance(v, D):
                dvals[dest] = v.x
                dvalid[dest] = True
            else:
                ivals[dest] = v.x
                ivalid[dest] = True
    # string and array values are built over their own entries only, then spread out
    s_at = np.cumsum(svalid) - 1
    j_at = np.cumsum(jvalid) - 1
    svals, jvals = _Strings(int(svalid.sum()), bufs), _Strings(int(jvalid.sum()), bufs)
    for dest, v in placed:
        if isinstance(v, A):
            jvals.put(j_at[dest], v)
        else:
            svals.put(s_at[dest], v)
    del placed
    attr_t = schema.field("attributes").type
    value_t = attr_t.value_type.field("value").type
    value = pa.StructArray.from_arrays(
        [types.array(), _expand(svals.array(), svalid), pa.array(ivals, pa.int64(), mask=~ivalid),
         pa.array(dvals, pa.float64(), mask=~dvalid), pa.nulls(e, pa.bool_()), pa.nulls(e, pa.binary()),
         _expand(jvals.array(), jvalid)],
        fields=list(value_t))
    child = pa.StructArray.from_arrays([keys.array(), value], fields=list(attr_t.value_type))
    attributes = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32), pa.int32()), child)

    # resource attributes: one list per service, repeated by index
    res_list = [resource_attributes(s) for s in SERVICES]
    res_keys = [k for attrs in res_list for k, _ in attrs]
    res_vals = [v for attrs in res_list for _, v in attrs]
    res_off = np.cumsum([0] + [len(x) for x in res_list]).astype(np.int32)
    m = len(res_keys)
    res_value = pa.StructArray.from_arrays(
        [pa.array(["string"] * m), pa.array(res_vals), pa.nulls(m, pa.int64()), pa.nulls(m, pa.float64()),
         pa.nulls(m, pa.bool_()), pa.nulls(m, pa.binary()), pa.nulls(m, pa.string())], fields=list(value_t))
    res_groups = pa.ListArray.from_arrays(pa.array(res_off), pa.StructArray.from_arrays(
        [pa.array(res_keys), res_value], fields=list(attr_t.value_type)))
    resource = res_groups.take(pa.array(np.repeat(base.svc, spt)))

    def empty_lists(t):
        return pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)), pa.array([], t.value_type))

    ts = schema.field("start_time").type
    zeros_u32 = pa.array(np.zeros(n, np.uint32))
    empty_str = pa.repeat(pa.scalar("", pa.string()), n)
    arrays = {
        "trace_id": cols["trace_id"].array(),
        "span_id": cols["span_id"].array(),
        "parent_span_id": cols["parent_span_id"].array(),
        "trace_state": empty_str,
        "flags": pa.array(np.full(n, 1, np.uint32)),
        "name": cols["name"].array(),
        "kind": cols["kind"].array(),
        "start_time": pa.array(start, pa.int64()).view(ts),
        "end_time": pa.array(end, pa.int64()).view(ts),
        "status_code": cols["status_code"].array(),
        "status_message": empty_str,
        "service_name": cols["service_name"].array(),
        **{col: cols[col].array() for col in PROMOTED},
        "attributes": attributes,
        "dropped_attributes_count": zeros_u32,
        "events": empty_lists(schema.field("events").type),
        "dropped_events_count": zeros_u32,
        "links": empty_lists(schema.field("links").type),
        "dropped_links_count": zeros_u32,
        "resource_attributes": resource,
        "resource_dropped_attributes_count": zeros_u32,
        "resource_schema_url": empty_str,
        "scope_name": cols["scope_name"].array(),
        "scope_version": cols["scope_version"].array(),
        "scope_attributes": empty_lists(schema.field("scope_attributes").type),
        "scope_dropped_attributes_count": zeros_u32,
        "scope_schema_url": empty_str,
        "received_time": pa.array(end + SEC, pa.int64()).view(ts),
    }
    return pa.Table.from_arrays([arrays[f.name] for f in schema], schema=schema)


def _subset(c: Ctx, idx) -> Ctx:
    out = Ctx()
    for k, v in vars(c).items():
        out.__dict__[k] = v[idx] if hasattr(v, "__len__") and hasattr(v, "dtype") else v
    return out


_SCHEMA = None


def _spans_schema():
    """nightshift's spans schema (the Parquet writer runs where nightshift is installed;
    the scalar renderer does not need it)."""
    global _SCHEMA
    if _SCHEMA is None:
        from nightshift.schemas.spans import SCHEMA

        _SCHEMA = SCHEMA
    return _SCHEMA


# --------------------------------------------------------------------------------------
# Writing a dataset
# --------------------------------------------------------------------------------------


def chunks(p: Params, chunk_spans: int) -> list[tuple[int, int]]:
    """Trajectory ranges, each inside one date, of about chunk_spans spans."""
    per = max(1, chunk_spans // p.spans_per_trajectory)
    out = []
    for d in range(p.days):
        lo, hi = day_start(p, d), day_start(p, d + 1)
        for a in range(lo, hi, per):
            out.append((a, min(hi, a + per)))
    return out


def write_chunk(p: Params, root: str, index: int, a: int, b: int, row_group_spans: int) -> tuple[int, int]:
    """Write trajectories [a, b) to <root>/spans/date=.../part-synth-<index>.parquet;
    returns (rows, bytes). zstd level 1, statistics on: the collector's settings."""
    import os

    import pyarrow.parquet as pq

    table = chunk_table(p, a, b)
    date = date_of_trajectory(p, a)
    folder = os.path.join(root, "spans", f"date={date}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"part-synth-{p.seed}-{index:05d}.parquet")
    tmp = path + ".tmp"
    pq.write_table(table, tmp, compression="zstd", compression_level=1, write_statistics=True,
                   row_group_size=row_group_spans)
    os.replace(tmp, path)
    return table.num_rows, os.path.getsize(path)


def _write_chunk_star(args):
    return write_chunk(*args)


def write_dataset(p: Params, root: str, *, chunk_spans: int = 200_000, row_group_spans: int = 10_000,
                  jobs: int = 1, progress=None) -> tuple[int, int, int]:
    """Write the whole dataset; returns (rows, bytes, files). `jobs` > 1 writes
    chunks in that many processes (spawned: the parent may hold Arrow threads)."""
    p.check()
    work = [(p, root, k, a, b, row_group_spans) for k, (a, b) in enumerate(chunks(p, chunk_spans))]
    rows = size = done = 0
    if jobs <= 1 or len(work) == 1:
        results = map(_write_chunk_star, work)
        for r, s in results:
            rows, size, done = rows + r, size + s, done + 1
            if progress:
                progress(done, len(work), rows)
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
            for r, s in ex.map(_write_chunk_star, work):
                rows, size, done = rows + r, size + s, done + 1
                if progress:
                    progress(done, len(work), rows)
    return rows, size, len(work)
