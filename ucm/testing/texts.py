"""Real English text available offline, and prompts of a chosen token length built from it.

Random token ids make poor prompts for a KV cache: a real model's KV on real text has the statistics that codecs
and correctness checks depend on. The sources are licence texts found on any Debian machine
(``/usr/share/common-licenses``) and the ``LICENSE.txt`` of the Python installation, read in a fixed order so the
same call returns the same text on every run.
"""

from __future__ import annotations

import functools
import sys
import sysconfig
from pathlib import Path
from typing import Protocol

_COMMON_LICENSES = Path("/usr/share/common-licenses")
# In order of preference. GPL-3 first: long (~35 K characters, ~7.5 K SmolLM2 tokens) and plain prose.
_DEBIAN_LICENSES = ("GPL-3", "GPL-2", "Apache-2.0", "GFDL-1.3", "MPL-2.0", "LGPL-2.1", "Artistic")
_SEPARATOR = "\n\n"


class Tokenizer(Protocol):
    """The part of a Hugging Face (or vLLM) tokenizer that ``prompt_of_tokens`` uses."""

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


def _python_license_paths() -> list[Path]:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    paths = [
        Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt",
        Path(sys.base_prefix) / "lib" / version / "LICENSE.txt",
        Path(sys.base_prefix) / "LICENSE.txt",  # Windows layout
    ]
    return list(dict.fromkeys(paths))  # drop duplicates, keep order


@functools.cache
def _sources() -> tuple[str, ...]:
    """The texts of all sources present on this machine, in order of preference."""
    texts: list[str] = []
    seen: set[Path] = set()
    for path in [_COMMON_LICENSES / name for name in _DEBIAN_LICENSES] + _python_license_paths():
        try:
            resolved = path.resolve()
            if resolved in seen or not resolved.is_file():
                continue
            text = resolved.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        seen.add(resolved)
        if text.strip():
            texts.append(text)
    return tuple(texts)


def real_text(min_chars: int | None = None) -> str:
    """Return real English text read from local files, the same on every call.

    With ``min_chars=None``, the first source found (on Debian: the GPL-3, 35 K characters). Otherwise sources are
    joined (blank line between) until the text has at least ``min_chars`` characters; it is never padded by
    repeating itself, since repeated text would create artificial prefix-cache hits.

    Raises:
        ValueError: ``min_chars`` is negative.
        RuntimeError: no source file is readable, or all of them together are shorter than ``min_chars``
            (the message gives the total available).
    """
    if min_chars is not None and min_chars < 0:
        raise ValueError(f"min_chars={min_chars} must be >= 0 or None")
    text = _join_sources(min_chars)
    if min_chars is not None and len(text) < min_chars:
        raise RuntimeError(f"min_chars={min_chars} exceeds the {len(text)} characters of text on this machine")
    return text


def _join_sources(min_chars: int | None) -> str:
    """The first source, joined with the next ones while shorter than ``min_chars``; all of them at most."""
    sources = _sources()
    if not sources:
        raise RuntimeError(
            f"no text source found: looked for {_COMMON_LICENSES}/{{{','.join(_DEBIAN_LICENSES)}}} and "
            f"{[str(p) for p in _python_license_paths()]}"
        )
    text = sources[0]
    for extra in sources[1:]:
        if min_chars is None or len(text) >= min_chars:
            break
        text = text + _SEPARATOR + extra
    return text


def prompt_of_tokens(tokenizer: Tokenizer, n_tokens: int, source_text: str | None = None) -> str:
    """Return a prefix of real text that is about ``n_tokens`` tokens long for ``tokenizer``.

    The text is encoded without special tokens and the first ``n_tokens`` ids decoded; re-encoding the result gives
    ``n_tokens`` ids, give or take one where the cut splits a word or whitespace run differently.
    ``source_text`` defaults to ``real_text`` (extended with further sources as needed), so a shorter prompt is a
    prefix of a longer one, as text and (but for the last token or so) as tokens: handy for prefix-cache tests.

    Raises:
        ValueError: ``n_tokens`` < 1, or ``source_text`` is given and has fewer than ``n_tokens`` tokens.
        RuntimeError: ``source_text`` is None and all text on this machine has fewer than ``n_tokens`` tokens
            (about 34 K SmolLM2 tokens on Debian), or no source is readable.
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens={n_tokens} must be >= 1")
    if source_text is not None:
        ids = tokenizer.encode(source_text, add_special_tokens=False)
        if len(ids) < n_tokens:
            raise ValueError(f"source_text has {len(ids)} tokens, fewer than n_tokens={n_tokens}")
    else:
        # English prose is about 4-5 characters per token: take enough sources for 6 per token, then all of them.
        text = _join_sources(6 * n_tokens)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < n_tokens:
            text = _join_sources(sys.maxsize)
            ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < n_tokens:
            raise RuntimeError(f"n_tokens={n_tokens} exceeds the {len(ids)} tokens of text on this machine")
    return tokenizer.decode(ids[:n_tokens])


def source_texts() -> tuple[str, ...]:
    """The texts of all sources found on this machine, each whole, in the fixed order of preference.

    On Debian: GPL-3, GPL-2, Apache-2.0, GFDL-1.3, MPL-2.0, LGPL-2.1, Artistic, then Python's LICENSE.txt. Callers
    that give texts different roles (haystack, held-out, documents) pick them by index.

    Raises:
        RuntimeError: no source file is readable.
    """
    sources = _sources()
    if not sources:
        _join_sources(None)  # raises the descriptive error
    return sources
