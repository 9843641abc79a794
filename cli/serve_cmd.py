"""`nightshift serve`: the model server agents talk to and `nightshift publish`
publishes to. vLLM in production; a transformers stand-in where vLLM cannot run."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import threading

from nightshift.settings import flags_of, load

from .helptext import epilog

DESCRIPTION = """Serve the policy over vLLM's OpenAI-compatible API with LoRA adapters loadable at
run time, so `nightshift publish` can put each new version in front of the agents.

--engine vllm (production, needs a GPU) starts `vllm serve` with the flags
Nightshift needs: --enable-lora, --max-lora-rank, --max-loras, a tool-call parser,
and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment.

--engine transformers is a stand-in for machines without a GPU (a laptop, CI, the
demo): transformers + peft behind the same API subset (POST /v1/chat/completions
with streaming, tools, logprobs and return_token_ids; GET /v1/models; POST
/v1/load_lora_adapter and /v1/unload_lora_adapter with vLLM's exact request and
response shapes; "model": <adapter name> selects the adapter). It really loads
the adapters, one request at a time, on the CPU: not vLLM's speed."""

EPILOG = """Examples:
  nightshift serve --engine vllm --model Qwen/Qwen2.5-1.5B-Instruct --max-lora-rank 64
  nightshift serve --engine transformers --model nightshift-data/models/tiny-qwen2 --port 8000
  nightshift serve --engine vllm --model /models/q --dry-run     # print the vllm command only

Then: OPENAI_BASE_URL=http://127.0.0.1:8000/v1 for the agents, and
`nightshift publish --checkpoint nightshift-checkpoints/v0001 --vllm-url http://127.0.0.1:8000`."""


def add_serve(sub, common) -> None:
    from nightshift.serve.config import ServeConfig

    s = sub.add_parser("serve", help="serve the model (vLLM, or a transformers stand-in without a GPU)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=epilog(EPILOG, "the `serve:` section", "NIGHTSHIFT_SERVE_*, VLLM_API_KEY",
                                     "transformers: 0 stopped by SIGTERM or SIGINT, 2 bad settings or a --model that "
                                     "is not a local folder; vllm: 2 when vllm is not installed, else the exit code "
                                     "of `vllm serve`, which replaces this process"))
    common(s, ServeConfig, "serve")
    s.add_argument("--dry-run", dest="dry_run", action="store_true", help="vllm: print the command and exit")
    s.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more flags passed to `vllm serve`")
    s.set_defaults(func=cmd_serve)


def vllm_command(cfg, extra: list[str] | None = None) -> list[str]:
    """`vllm serve` with what publishing needs; `cfg`: a `ServeConfig`."""
    cmd = ["vllm", "serve", cfg.model, "--host", cfg.host, "--port", str(cfg.port), "--enable-lora",
           "--max-lora-rank", str(cfg.max_lora_rank), "--max-loras", str(cfg.max_loras),
           "--max-cpu-loras", str(max(cfg.max_loras, 2 * cfg.max_loras)),
           "--enable-auto-tool-choice", "--tool-call-parser", cfg.tool_call_parser]
    if cfg.served_model_name:
        cmd += ["--served-model-name", cfg.served_model_name]
    if cfg.api_key:
        cmd += ["--api-key", cfg.api_key]
    if cfg.dtype != "auto":
        cmd += ["--dtype", {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[cfg.dtype]]
    return cmd + [a for a in (extra or []) if a != "--"]


def vllm_logging_config(level: str) -> dict:
    """A `logging.config.dictConfig` for vLLM that writes its records (and the
    uvicorn server's it runs) as our JSON lines on stderr: vLLM reads such a file
    from VLLM_LOGGING_CONFIG_PATH (VLLM_CONFIGURE_LOGGING left on), so `nightshift
    serve --engine vllm` logs like every other Nightshift process."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    loggers = {name: {"handlers": ["json"], "level": level.upper(), "propagate": False}
               for name in ("vllm", "uvicorn", "uvicorn.access", "uvicorn.error")}
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"json": {"()": "nightshift.settings.logs.JsonFormatter"}},
            "handlers": {"json": handler}, "loggers": loggers}


def vllm_json_logging(level: str) -> dict[str, str]:
    """The variables that make `vllm serve` log JSON lines: the config above in a
    file of its own, which vLLM's logger reads when it is set up (vLLM needs a GPU:
    tests apply the config itself, not vLLM)."""
    import json
    import tempfile

    fd, path = tempfile.mkstemp(prefix="nightshift-vllm-logging-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(vllm_logging_config(level), f)
    return {"VLLM_CONFIGURE_LOGGING": "1", "VLLM_LOGGING_CONFIG_PATH": path}


def cmd_serve(args: argparse.Namespace) -> int:
    from .console import say, setup_logging
    from nightshift.serve.config import ServeConfig

    cfg = load(ServeConfig, "serve", args.config, flags_of(ServeConfig, args))
    cfg.api_key = cfg.api_key or os.environ.get("VLLM_API_KEY", "")
    setup_logging(cfg.log_level, args.log_format)
    if cfg.engine == "vllm":
        cmd = vllm_command(cfg, args.extra)
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        shown = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
        if args.log_format == "json":
            env.update(vllm_json_logging(cfg.log_level))
            shown += f"VLLM_LOGGING_CONFIG_PATH={env['VLLM_LOGGING_CONFIG_PATH']} "
        print(shown + " ".join(cmd), flush=True)
        if args.dry_run:
            return 0
        if not shutil.which("vllm"):
            say("nightshift serve: `vllm` is not installed here (its wheel needs a CUDA GPU). Install it where the "
                "GPU is (`pip install vllm`), or use --engine transformers on a machine without one.", args.log_format)
            return 2
        os.execvpe("vllm", cmd, env)
    from nightshift.serve.engine import Engine

    from .console import adopt_libraries

    adopt_libraries(args.log_format)
    from nightshift.serve.http import serve

    if not os.path.isdir(cfg.model):
        say(f"nightshift serve: --model {cfg.model} is not a local folder (nothing is downloaded)", args.log_format)
        return 2
    engine = Engine(cfg.model, cfg.served_model_name, cfg.max_lora_rank, cfg.max_loras, cfg.dtype)
    server = serve(engine, cfg.host, cfg.port, cfg.api_key)
    stop = threading.Event()

    def on_term(*_):
        stop.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    logging.getLogger("nightshift.serve").warning(
        "transformers engine (a stand-in for vLLM: same API, CPU speed) serving %s on http://%s:%d/v1",
        engine.served_name, cfg.host, server.server_address[1])
    server.serve_forever()
    server.server_close()
    return 0
