"""A client of the control API, for the nightly job, the watch and
`nightshift route set|show|delete`: standard library only, errors with the
proxy's own message."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request


def prompt_name(match: str) -> str:
    """The route name of the prompt route matching the system id `match`."""
    return "prompt:" + match


class RouteError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class RouteClient:
    def __init__(self, url: str, token: str = "", timeout: float = 10.0) -> None:
        self.url, self.token, self.timeout = url.rstrip("/"), token, timeout

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(self.url + path, method=method, data=None if body is None else
                                     json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                message = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = raw.decode(errors="replace") or str(e)
            raise RouteError(e.code, message) from None
        except OSError as e:
            raise RouteError(0, f"cannot reach the routing proxy at {self.url}: {e}") from None

    @staticmethod
    def _path(name: str) -> str:
        return "/nightshift/routes/" + urllib.parse.quote(name, safe="@:")

    def routes(self) -> dict:
        """{"routes": [{"name", "serving", "candidate", "share", "updated"}], "missing": {...}, "upstream": url}"""
        return self._call("GET", "/nightshift/routes")

    def _unless_404(self, method: str, path: str, key: str) -> dict | None:
        try:
            return self._call(method, path)[key]
        except RouteError as e:
            if e.status == 404:
                return None
            raise

    def get(self, name: str) -> dict | None:
        return self._unless_404("GET", self._path(name), "route")

    def set(self, name: str, serving: str, candidate: str | None = None, share: float = 0.0) -> dict:
        """The route as stored (persisted before the proxy answered)."""
        body = {"serving": serving, "candidate": candidate, "share": share}
        return self._call("PUT", self._path(name), body)["route"]

    def set_prompt(self, match: str, candidate: str, system: str | list[str], share: float, *, agent: str = "",
                   model: str = "", match_system: list[str] | None = None, version: str = "") -> dict:
        """Put a prompt candidate on a share of the conversations whose system prompt is
        `match` (its system id); the route as stored. `system` is the candidate's text,
        checked by the proxy against `candidate` (its system id); `version`, the id its
        rewritten answers are marked with (the trial's version_id)."""
        body = {"kind": "prompt", "candidate": candidate, "system": system, "share": share, "agent": agent,
                "model": model}
        if match_system is not None:
            body["match_system"] = match_system
        if version:
            body["version"] = version
        return self._call("PUT", self._path(prompt_name(match)), body)["route"]

    def delete(self, name: str) -> dict | None:
        """The route deleted, or None when there was none."""
        return self._unless_404("DELETE", self._path(name), "deleted")
