"""`nightshift route`: the canary routing proxy in front of vLLM, and
`nightshift route show|set|delete`, which change a running one's routes."""

from __future__ import annotations

import argparse
import sys

from nightshift.settings import SettingsError, add_flags, flags_of, load

from .console import log_format_flag, say
from .helptext import epilog

DESCRIPTION = """An OpenAI-compatible proxy in front of vLLM (off unless you start it). Agents point
their base URL at it (OPENAI_BASE_URL=http://127.0.0.1:8100/v1) instead of at vLLM.
A request for a stable name in the route table (`agent`) goes to its serving
version or, for a share of conversations, its candidate: sticky per conversation
(X-Nightshift-Route-Key header, else the traceparent's trace id, else the first
system and user message), only the body's `model` rewritten, the answer streamed
back unchanged with `X-Nightshift-Route: <version>`. Other models pass through
byte for byte. Only the inference API is forwarded (/v1/chat/completions,
/v1/completions, /v1/responses, /v1/embeddings, GET /v1/models); vLLM's admin
API and every other path are refused. A version the upstream does not have
falls back to the serving one, with a warning and a metric.

Control API (Bearer --admin-token when set; only for a Host the proxy goes by, see
--allowed-hosts, never a browser's cross-origin request), each change fsync'd
before the 200:
  GET    /nightshift/routes
  PUT    /nightshift/routes/<stable name>  {"serving": "agent@v0003", "candidate": "agent@v0004", "share": 0.1}
  DELETE /nightshift/routes/<stable name>
  PUT    /nightshift/routes/prompt:<id>  {"kind": "prompt", "candidate": <id>, "system": <its text>, "share": 0.1}
A prompt route puts a candidate system prompt (its text checked against its id)
in a sticky share of the conversations whose system prompt has that id (the
agent's prompt, per-request data folded): only the leading system messages (or
the Responses API's instructions) change, and the answers' model is marked
+p:<version> so the build knows which prompt the model saw.
plus GET /healthz and GET /metrics (Prometheus). SIGTERM lets answers in flight
finish (--drain-timeout), then exits 0."""

EPILOG = """Examples:
  nightshift route --upstream http://127.0.0.1:8000 --listen 127.0.0.1:8100
  nightshift route set agent --serving agent@v0003 --candidate agent@v0004 --share 0.1
  nightshift route set agent --serving agent@v0004          # promote: all traffic to one version
  nightshift route show
  nightshift route delete agent
  nightshift route prompt --from store/support-agent/v0003 --share 0.1   # a prompt candidate on 10 %"""

ROUTE_SETTINGS = ("the `route:` section", "NIGHTSHIFT_ROUTE_*")


def add_route(sub, common=None) -> None:
    from nightshift.route.config import RouteConfig

    p = sub.add_parser("route", help="the canary routing proxy in front of vLLM (and show/set/delete its routes)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=epilog(EPILOG, *ROUTE_SETTINGS, "0 stopped by SIGTERM after draining, 2 bad settings or "
                                     "it cannot start (the address taken, the route table unreadable: one sentence); "
                                     "show, set and delete: 0 done, 1 the proxy refused or could not be reached, 2 "
                                     "bad settings"))
    p.add_argument("--config", metavar="FILE", help="YAML settings file (its `route:` section)")
    add_flags(p, RouteConfig)
    log_format_flag(p)
    p.set_defaults(func=cmd_route)
    acts = p.add_subparsers(dest="route_action", metavar="ACTION")

    control = epilog("", *ROUTE_SETTINGS, "0 done, 1 the proxy refused or could not be reached, 2 bad settings")
    s = acts.add_parser("show", help="the routes of a running proxy, and the versions it found missing",
                        description="The routes of a running proxy, and the versions it found missing upstream.",
                        epilog=control, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("name", nargs="?", help="one stable name (default: all)")
    _control_flags(s)
    s.set_defaults(func=cmd_show)

    t = acts.add_parser("set", help="route a stable name: a serving version and, optionally, a candidate's share",
                        description="Replace the route of a stable name on a running proxy (written to its state "
                        "file before it answers). Without --candidate all traffic goes to --serving.",
                        epilog=control, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("name", help="the stable name the agents ask for, e.g. agent")
    t.add_argument("--serving", required=True, metavar="MODEL", help="the version serving, e.g. agent@v0003")
    t.add_argument("--candidate", metavar="MODEL", help="the version on trial, e.g. agent@v0004")
    t.add_argument("--share", type=float, default=0.0, help="the candidate's share of conversations, in [0, 1]")
    _control_flags(t)
    t.set_defaults(func=cmd_set)

    d = acts.add_parser("delete", help="remove a route: requests for that name pass through untouched again",
                        description="Remove the route of a stable name on a running proxy: requests for that name "
                        "pass through untouched again.", epilog=control,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("name", help="the stable name (or prompt:<id> for a prompt route)")
    _control_flags(d)
    d.set_defaults(func=cmd_delete)

    pr = acts.add_parser("prompt", help="put a prompt candidate on a share of one agent's conversations",
                         description="Route a prompt candidate: requests whose system prompt is the candidate's "
                         "parent (matched by its id, per-request data folded) get the candidate's text in its place "
                         "for --share of the conversations, sticky per conversation; their answers' model is marked "
                         "+p:<version>. --from reads a stored candidate's folder (<apo.store>/<agent>/vNNNN); or give "
                         "--match, --candidate and --text-file. Share 0 keeps the route but rewrites nothing; "
                         "`delete prompt:<match>` removes it.",
                         epilog=control, formatter_class=argparse.RawDescriptionHelpFormatter)
    pr.add_argument("--from", dest="source", metavar="DIR", help="a stored candidate's folder (its manifest.json)")
    pr.add_argument("--match", metavar="ID", help="the system id of the agent's prompt (nightshift prompts' "
                                                  "system_hash)")
    pr.add_argument("--candidate", metavar="ID", help="the candidate's system id")
    pr.add_argument("--text-file", metavar="FILE", help="the candidate's text (checked against --candidate)")
    pr.add_argument("--share", type=float, required=True, help="the candidate's share of conversations, in [0, 1]")
    pr.add_argument("--agent", default=None, help="the agent's name, for logs")
    pr.add_argument("--model", default=None, help="the model the agent asks for (how a changed prompt is noticed)")
    _control_flags(pr)
    pr.set_defaults(func=cmd_prompt)


def _control_flags(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: given before the action (`nightshift route --config f show`), the route parser's value stays
    p.add_argument("--url", default=argparse.SUPPRESS, metavar="URL",
                   help="the proxy (default: http:// + its --listen address from the settings)")
    p.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE", help="YAML settings file")
    p.add_argument("--admin-token", dest="admin_token", default=argparse.SUPPRESS, metavar="TOKEN",
                   help="the proxy's admin token (default: NIGHTSHIFT_ROUTE_ADMIN_TOKEN / route.admin_token)")
    log_format_flag(p, default=argparse.SUPPRESS)


def _settings(args: argparse.Namespace):
    from nightshift.route.config import RouteConfig

    cfg = load(RouteConfig, "route", getattr(args, "config", None), flags_of(RouteConfig, args))
    cfg.check()
    return cfg


def cmd_route(args: argparse.Namespace) -> int:
    from .console import setup_logging

    fmt = getattr(args, "log_format", None) or ""
    try:
        cfg = _settings(args)
    except SettingsError as e:
        say(f"nightshift route: {e}", fmt)
        return 2
    setup_logging(cfg.log_level, fmt)
    from nightshift.route.server import run

    return run(cfg)


def _client(args: argparse.Namespace):
    from nightshift.route.client import RouteClient

    cfg = _settings(args)
    url = getattr(args, "url", None)
    if not url:
        host, port = cfg.host_port()
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    return RouteClient(url, cfg.admin_token)


def _line(r: dict) -> str:
    if r.get("kind") == "prompt":
        who = f" (agent {r['agent']})" if r.get("agent") else ""
        return f"{r['name']}{who}: candidate {r['candidate']} at {100 * r['share']:g} % of the conversations"
    if not r.get("candidate"):
        return f"{r['name']}: all to {r['serving']}"
    return f"{r['name']}: {r['serving']}, candidate {r['candidate']} at {100 * r['share']:g} %"


def _control(args: argparse.Namespace, action) -> int:
    from nightshift.route.client import RouteError

    try:
        for line in action(_client(args)):
            print(line)
    except SettingsError as e:
        say(f"nightshift route: {e}", getattr(args, "log_format", None) or "")
        return 2
    except RouteError as e:
        say(f"nightshift route {args.route_action}: {e}", getattr(args, "log_format", None) or "")
        return 1
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    def show(client):
        doc = client.routes()
        routes = [r for r in doc["routes"] if args.name in (None, r["name"])]
        lines = [_line(r) for r in routes] or ["no routes: every request passes through to " + doc["upstream"]]
        lines += [f"missing on the upstream (skipped for {s:g} s more): {v}" for v, s in doc["missing"].items()]
        for name, seen in (doc.get("prompts") or {}).items():
            if args.name in (None, name):
                lines.append(f"{name}: {seen['matched']:,} requests matched since the proxy started, "
                             f"{seen['rewritten']:,} rewritten" + (f", {sum(seen['skipped'].values()):,} passed "
                             "unchanged (ambiguous)" if seen["skipped"] else "")
                             + (f"; the agent now sends prompt {seen['changed']}: the trial no longer applies"
                                if seen["changed"] else ""))
        return lines

    return _control(args, show)


def cmd_set(args: argparse.Namespace) -> int:
    return _control(args, lambda c: [_line(c.set(args.name, args.serving, args.candidate, args.share))])


def _prompt_route(args: argparse.Namespace) -> dict:
    """The PUT's fields, from a candidate's manifest or the flags (SettingsError: one sentence)."""
    import json
    from pathlib import Path

    got = {"agent": args.agent, "model": args.model, "match": args.match, "candidate": args.candidate, "system": None}
    if args.source:
        folder = Path(args.source)
        try:
            man = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
            got = {"agent": args.agent or folder.resolve().parent.name, "model": args.model or man.get("model") or "",
                   "match": man["parent"]["system_hash"], "candidate": man["candidate"]["system_hash"],
                   "system": man["candidate"]["system"], "match_system": _parent_template(folder,
                                                                                         man["parent"]["system_hash"]),
                   "version": man["candidate"].get("version_id") or ""}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SettingsError(f"--from {folder}: not a stored prompt candidate ({type(e).__name__}: {e})") from None
    elif args.text_file:
        try:
            got["system"] = Path(args.text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SettingsError(f"--text-file {args.text_file}: cannot be read ({e})") from None
    if not (got["match"] and got["candidate"] and got["system"]):
        raise SettingsError("give --from a candidate's folder, or --match, --candidate and --text-file")
    return got


def _parent_template(folder, match: str) -> list[str] | None:
    """The agent's prompt as a template (parent/prompt.json's system texts), when it is
    the one matched: the proxy then recognises renderings of {{var}} slots, and skips
    folding prompts that do not hold its text."""
    import json

    from nightshift.schemas.prompt_identity import system_id

    try:
        texts = json.loads((folder / "parent" / "prompt.json").read_text(encoding="utf-8"))["system"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ok = isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts) and system_id(texts) == match
    return texts if ok else None


def cmd_prompt(args: argparse.Namespace) -> int:
    def put(client):
        got = _prompt_route(args)
        return [_line(client.set_prompt(got["match"], got["candidate"], got["system"], args.share,
                                        agent=got["agent"] or "", model=got["model"] or "",
                                        match_system=got.get("match_system"), version=got.get("version") or ""))]

    return _control(args, put)


def cmd_delete(args: argparse.Namespace) -> int:
    def delete(client):
        gone = client.delete(args.name)
        return [f"deleted {_line(gone)}" if gone else f"no route for {args.name!r}: nothing to delete"]

    return _control(args, delete)


def main(argv: list[str] | None = None) -> int:
    """`python -m nightshift.cli.route_cmd route ...`: the same command outside `nightshift`."""
    from nightshift.settings import log_format

    p = argparse.ArgumentParser(prog="nightshift")
    add_route(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    try:
        args.log_format = log_format(getattr(args, "config", None), getattr(args, "log_format", None))
    except SettingsError as e:
        say(f"nightshift route: {e}")
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
