"""What a runner's or a provider's exception text may carry that no peer may read.

A run that raises ends its child with the exception's text as ``error`` (design §20),
and that text crosses to everyone who reads the child: the peer over the wire (every
page carries it), the database row, ``delegation show``/``children``/``events`` and the
web page. A provider's exception is untrusted text: it may quote its request (the URL,
its headers, the body). :func:`redact_secrets` replaces every shape of credential below
with ``[redacted]`` before the text is stored, so nothing downstream ever holds it:

* a URL's userinfo, of any scheme (``https://svc:pw@proxy/``, ``postgresql://u:pw@h/db``);
* a URL's query string, and a fragment holding ``=`` (``#access_token=…``);
* an ``Authorization`` (``Proxy-Authorization``) value, ``Bearer``/``Basic`` tokens;
* ``Cookie``/``Set-Cookie`` headers: the rest of their line;
* a named secret's value: ``key=``, ``api_key:``, ``"token": "…"``, ``password=``,
  ``secret``, ``session_id``, ``sid``, ``signature``, ``credentials``… (any name ending
  so, quoted or not, with ``=`` or ``:``);
* JSON Web Tokens (``eyJ….….…``) and vendors' key prefixes (``sk-``, ``ghp_``, ``AKIA``,
  ``AIza``, ``xox?-``, ``hf_``, ``glpat-``, ``sk_live_``…);
* runs of 32 or more hex digits mixing digits and letters (SHA digests, hex keys), but
  for ids of ours: ``c-``, ``r-`` or ``h-`` and exactly 32 lower-case hex digits
  (conversations, runs, hosts);
* base64-like runs: 24 or more letters and digits with upper case, lower case and a
  digit alike (between ``/``: a path's words are not), or 16 or more with ``+`` or
  ``=`` padding and all three.

Where it stops: this is a list of shapes. A secret in no listed shape (a short
lower-case password in prose, ``my password is hunter2``) is kept, and so is whatever
a run emits as its own events: only the error a run ends with passes here (and the
text of a failed tool call the pydantic-ai runner emits).
"""

from __future__ import annotations

import re

REDACTED = "[redacted]"

# A value: up to white space, a quote or a closing bracket, a separator.
_VALUE = r"[^\s\"',;&)}\]]+"
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/?#'\"<>]*@")
_QUERY = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s?#'\"<>]+)\?[^\s#'\"<>]*")
_FRAGMENT = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s#'\"<>]+)#[^\s'\"<>]*=[^\s'\"<>]*")
_AUTHORIZATION = re.compile(
    r"(?i)\b((?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?"
    r"(?:(?:bearer|basic|token|digest|apikey|key)\s+)?)" + _VALUE
)
_COOKIE = re.compile(r"(?i)\b((?:set-)?cookie2?[\"']?\s*[:=]\s*)[^\r\n]*")
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}")
_NAMED = re.compile(
    r"(?i)\b([\w.-]*?(?:key|token|secret|password|passwd|passphrase|pwd|credentials?"
    r"|signature|sig|session(?:[_-]?id)?|sessid|sid|auth|jwt)[\"']?\s*[:=]\s*[\"']?)" + _VALUE
)
_JWT = re.compile(r"\beyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*")
_KEYLIKE = re.compile(
    r"\b(?:sk-(?:ant-|proj-)?[A-Za-z0-9_-]{8,}|gh[pousr]_[A-Za-z0-9]{16,}|github_pat_\w{16,}"
    r"|xox[abeprs]-[A-Za-z0-9-]{10,}|AIza[0-9A-Za-z_-]{20,}|AKIA[0-9A-Z]{16}|hf_[A-Za-z0-9]{16,}"
    r"|glpat-[A-Za-z0-9_-]{16,}|[rsp]k_(?:live|test)_[A-Za-z0-9]{16,}|npm_[A-Za-z0-9]{20,})"
)
_HEX = re.compile(r"(?<![0-9A-Za-z])((?:[crh]-)?)([0-9a-fA-F]{32,})(?![0-9A-Za-z])")
_RUN = re.compile(r"(?<![A-Za-z0-9+/=_-])[A-Za-z0-9+/_-]{16,}=*(?![A-Za-z0-9+/=_-])")


def redact_secrets(text: str) -> str:
    """``text`` with every credential shape of this module's list replaced by
    ``[redacted]``. For the error a child ends with, which every page of the child
    carries to its peer (a provider's exception text may quote its request)."""
    text = _USERINFO.sub(rf"\1{REDACTED}@", text)
    text = _QUERY.sub(rf"\1?{REDACTED}", text)
    text = _FRAGMENT.sub(rf"\1#{REDACTED}", text)
    text = _AUTHORIZATION.sub(rf"\1{REDACTED}", text)
    text = _COOKIE.sub(rf"\1{REDACTED}", text)
    text = _BEARER.sub(rf"\1 {REDACTED}", text)
    text = _NAMED.sub(rf"\1{REDACTED}", text)
    text = _JWT.sub(REDACTED, text)
    text = _KEYLIKE.sub(REDACTED, text)
    text = _HEX.sub(_hex, text)
    return _RUN.sub(_run, text)


def _hex(found: re.Match[str]) -> str:
    prefix, digits = found.group(1), found.group(2)
    if prefix and len(digits) == 32 and digits == digits.lower():
        return found.group(0)  # an id of ours: c-, r- or h- and 32 lower-case hex digits
    if digits.isdigit() or not any(c.isdigit() for c in digits):
        # A number, or letters a-f alone ("aaaa…", "deadbeefcafe…"): a digest or a key has
        # both (a random 32-digit hex run lacks one with odds under 1 in 10^13).
        return found.group(0)
    return prefix + REDACTED


def _run(found: re.Match[str]) -> str:
    run = found.group(0)
    if ("+" in run or run.endswith("=")) and _mixed(run):
        return REDACTED  # base64 with its own alphabet's marks
    return "/".join(REDACTED if len(p) >= 24 and _mixed(p) else p for p in run.split("/"))


def _mixed(text: str) -> bool:
    """Upper case, lower case and a digit alike: a key's, not a word's or an id's."""
    return (
        any(c.isupper() for c in text)
        and any(c.islower() for c in text)
        and any(c.isdigit() for c in text)
    )
