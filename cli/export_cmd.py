"""`nightshift export`: the transitions in the chat formats trainers read."""

from __future__ import annotations

import argparse

from nightshift.settings import flags_of, load

from .build_cmd import TRANSFORM_SETTINGS
from .helptext import epilog

DESCRIPTION = """Write the transitions under --data as training examples in OpenAI / TRL chat
format, tool calls nested as {"id", "type": "function", "function": {"name",
"arguments"}}, to Parquet (.parquet) or JSON lines (.jsonl, .json):

  --format messages            {"messages": [..., assistant], "tools": [...]}: TRL's SFTTrainer,
                               OpenAI's chat fine-tuning
  --format prompt_completion   {"prompt": [...], "completion": [assistant], "tools": [...]}:
                               TRL's conversational prompt-completion (loss on the answer only)

Each example keeps its transition_id, trajectory_id, step, agent_name, model,
reward, return, advantage and weight. Tool-call arguments are a mapping (what chat
templates render) or, with --arguments text, the model's JSON text (OpenAI's
files). In Parquet the messages are JSON (Arrow's arrow.json type): Hugging Face
`datasets` gives back exactly the dicts written, with no keys made up. Rows
recorded without their messages (content capture off) are left out and counted."""

EPILOG = """Examples:
  nightshift export --to sft.parquet --rewarded
  nightshift export --to openai.jsonl --arguments text --agents '^writer$'

  # Hugging Face datasets (>= 4.7) and TRL:
  from datasets import load_dataset
  ds = load_dataset("parquet", data_files="sft.parquet", split="train")
  ds = ds.filter(lambda r: r["advantage"] is not None and r["advantage"] > 0)
  text = tokenizer.apply_chat_template(ds[0]["messages"], tools=ds[0]["tools"], tokenize=False)

  # Polars:
  import polars as pl
  df = pl.read_parquet("sft.parquet")
  df = df.with_columns(df["messages"].ext.storage().str.json_decode())
  df.group_by("agent_name").agg(pl.len(), pl.col("reward").mean())"""


def add_export(sub, common) -> None:
    from nightshift.transform.config import TransformConfig
    from nightshift.transform.export_formats import ARGUMENTS, FORMATS

    e = sub.add_parser("export", help="write the transitions as chat-format training examples (Parquet or JSON lines)",
                       description=DESCRIPTION, epilog=epilog(EPILOG, *TRANSFORM_SETTINGS,
                                                              "0 written, 1 nothing to export, 2 bad arguments or "
                                                              "transitions this version cannot read"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    common(e, TransformConfig, "transform", ("data", "storage_options", "since", "until"))
    e.add_argument("--to", required=True, metavar="FILE", help="the output: .parquet, .jsonl or .json")
    e.add_argument("--format", dest="fmt", choices=FORMATS, default="messages", help="default: messages")
    e.add_argument("--arguments", choices=ARGUMENTS, default="object",
                   help="tool-call arguments as a mapping (default, what chat templates render) or JSON text "
                        "(OpenAI's fine-tuning files)")
    e.add_argument("--rewarded", action="store_true", help="only rows with a reward")
    e.add_argument("--agents", default="", metavar="REGEX", help="only the agents whose name matches")
    e.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from nightshift.transform.config import TransformConfig
    from nightshift.schemas.layout import LayoutError
    from nightshift.transform.export import ExportError, NothingToExport, export

    from .console import say, setup_logging

    cfg = load(TransformConfig, "transform", args.config, flags_of(TransformConfig, args))
    setup_logging(args.log_level or "warning", args.log_format)
    try:
        st = export(cfg.data, args.to, args.fmt, args.arguments, rewarded_only=args.rewarded, agents=args.agents,
                    since=cfg.since, until=cfg.until, storage_options=cfg.storage_options)
    except (ExportError, LayoutError) as e:
        say(f"nightshift export: {e}", args.log_format)
        return 1 if isinstance(e, NothingToExport) else 2
    left = [f"{n} {why}" for n, why in ((st.no_content, "without their messages (content capture was off: see "
                                                        "`nightshift doctor`)"),
                                        (st.unrated, "without a reward"), (st.not_selected, "of other agents"),
                                        (st.prompt_trial, "answered under a route's prompt trial (their recorded "
                                                          "system prompt is not the one the model saw)")) if n]
    print(f"exported {st.written} of {st.rows} transitions to {args.to} ({args.fmt}, arguments as {args.arguments})"
          + (f"; left out: {', '.join(left)}" if left else ""))
    return 0 if st.written else 1
