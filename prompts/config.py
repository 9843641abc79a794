"""The `apo:` settings: where the proposer LLM is, how much it reads and writes, where
candidates go, and the optional screening command.

The key is never a setting: `api_key_env` names the environment variable that
holds it, so the key is in no file Nightshift reads or writes, and no log line.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from nightshift.settings import invalid, setting

_DATE = r"\d{4}-\d{2}-\d{2}"


def _url_problem(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{value!r} is not an http(s) URL such as http://127.0.0.1:8000/v1 or https://api.openai.com/v1"
    return ""


@dataclass
class ScreenSettings:
    """Offline screening of each candidate by your own evaluation, the weight gate's
    contract: a shell command that exits 0 to pass, and may print a JSON line last."""

    command: str = setting("", help="run through the shell for each candidate with NIGHTSHIFT_CANDIDATE (its folder: "
                                    "system.txt, prompt.json, manifest.json), NIGHTSHIFT_PUBLISHED (the parent's "
                                    "folder, same files), NIGHTSHIFT_BASE_MODEL (the model the agent calls), "
                                    "NIGHTSHIFT_KIND=prompt and NIGHTSHIFT_AGENT; exit 0 passes; a last stdout line "
                                    "of JSON with a numeric \"score\" ranks the candidates that pass (empty: none)")
    timeout: float = setting(1800.0, help="seconds before the command counts as failed", bounds="(0, inf)",
                             metavar="DURATION")


@dataclass
class ApoConfig:
    """Automatic prompt optimization: an OpenAI-compatible LLM reads an agent's failed
    and successful trajectories, critiques its system prompt and proposes edits."""

    data: str = setting("./nightshift-data", help="dataset root: a folder or an fsspec URL", metavar="DIR|URL")
    storage_options: dict = setting(factory=dict, help="passed to fsspec for data")
    since: str = setting("", help="only calls from this date on (default: all)", pattern=_DATE, metavar="YYYY-MM-DD")
    base_url: str = setting("", help="the proposer: an OpenAI-compatible API, e.g. https://api.openai.com/v1 or your "
                                     "vLLM's http://vllm:8000/v1", check=_url_problem, metavar="URL")
    model: str = setting("", help="the proposer's model name, as that API knows it")
    api_key_env: str = setting("", help="the environment variable holding the proposer's API key (sent as a Bearer "
                                        "token, never logged or written); empty: no key",
                               pattern=r"[A-Za-z_][A-Za-z0-9_]*", metavar="VARIABLE")
    meta_prompts: str = setting("", help="a folder of meta-prompt files (critique.md, edit*.md) replacing the built-in "
                                         "ones of the same name (`nightshift prompts meta` prints where those are)",
                                metavar="DIR")
    candidates_dir: str = setting("", help="where candidates are stored, one folder per agent, vNNNN inside "
                                           "(default: <data>/prompt-candidates)", metavar="DIR|URL")
    candidates: int = setting(4, help="edited prompts proposed per parent prompt", bounds="[1, 32]")
    beam_width: int = setting(2, help="parent prompts carried from night to night: the agent's own and the best "
                                      "screened candidates", bounds="[1, 16]")
    failures: int = setting(8, help="failed trajectories the critique reads (the lowest rewards)", bounds="[1, 200]")
    successes: int = setting(4, help="successful trajectories it reads beside them (0: none)", bounds="[0, 200]")
    min_trajectories: int = setting(30, help="rated trajectories a prompt version needs for an interval",
                                    bounds="[1, inf)")
    temperature: float = setting(1.0, help="the proposer's sampling temperature", bounds="[0, 2]")
    max_tokens: int = setting(4096, help="the most tokens the proposer may answer with, per call", bounds="[16, inf)")
    timeout: float = setting(120.0, help="seconds one proposer call may take", bounds="(0, inf)", metavar="DURATION")
    retries: int = setting(2, help="retries of a call that timed out, could not connect, or got 429 or 5xx",
                           bounds="[0, 10]")
    max_prompt_chars: int = setting(16000, help="a candidate longer than this is refused", bounds="[100, inf)")
    max_growth: float = setting(2.0, help="a candidate more than this many times its parent's length (plus 1,500 "
                                          "characters) is refused: prompts that only grow are a known way APO fails",
                                bounds="[1, inf)")
    max_request_chars: int = setting(60000, help="the most characters of trajectories sent in one critique",
                                     bounds="[1000, inf)")
    gate: ScreenSettings = setting(factory=ScreenSettings, help="screening")
    log_level: str = setting("info", help="debug, info, warning, error",
                             choices=("debug", "info", "warning", "error"))

    def rules(self) -> None:
        if self.api_key_env and not self.base_url:
            raise invalid("api_key_env", "a key without a proposer: set apo.base_url too")

    def store(self) -> str:
        return self.candidates_dir or f"{self.data.rstrip('/')}/prompt-candidates"
