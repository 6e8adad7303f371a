#!/usr/bin/env python3
"""Vendor the browser libraries used by the chat page (dolmus/server/ui/).

The page is served with ``Content-Security-Policy: default-src 'self'`` and
has no build step, so the few third-party scripts/stylesheets it needs are
copied, pinned, into ``dolmus/server/ui/vendor/``.

For every entry of ``PINNED`` below this script:

1. reads the version metadata from the npm registry,
2. downloads the tarball and verifies it against ``dist.integrity``
   (sha512, base64),
3. extracts only the listed files plus the licence file(s), flat, into
   ``vendor/<dest>/``,
4. records name, version, SPDX licence, tarball URL, integrity and the
   sha256 of each extracted file in ``vendor/VENDOR.json``.

Usage::

    python scripts/vendor_ui.py            # (re)create exactly the pinned files
    python scripts/vendor_ui.py --check    # re-hash files on disk against VENDOR.json
    python scripts/vendor_ui.py --upgrade  # bump PINNED to npm "latest", then vendor

Stdlib only (Python 3.11+). ``check()`` is importable for tests.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path
from typing import NamedTuple


class Package(NamedTuple):
    # NamedTuple, not a dataclass: works when this file is loaded with
    # importlib.util.spec_from_file_location without registering sys.modules.
    name: str  # npm package name
    version: str  # exact version
    dest: str  # sub-directory of vendor/
    files: tuple[str, ...]  # paths inside the package (tarball prefix stripped)
    licence_files: tuple[str, ...] = ("LICENSE",)


# Pinned table. Keep each ``Package("<name>", "<version>",`` on one line:
# ``--upgrade`` rewrites the version string in place.
PINNED: tuple[Package, ...] = (
    Package("marked", "18.3.0", dest="marked", files=("lib/marked.umd.js",)),  # minified UMD, global `marked`
    Package(
        "dompurify",
        "3.5.0",
        dest="dompurify",
        files=("dist/purify.min.js",),  # global `DOMPurify`
        licence_files=("LICENSE", "LICENSE-MPL"),
    ),  # (MPL-2.0 OR Apache-2.0)
    Package(
        "@highlightjs/cdn-assets",
        "11.12.0",
        dest="highlight",
        files=(
            "highlight.min.js",  # common languages, global `hljs`
            "styles/github.min.css",
            "styles/github-dark.min.css",
        ),
    ),
    Package(
        "uplot",
        "1.6.32",
        dest="uplot",
        files=(
            "dist/uPlot.iife.min.js",  # global `uPlot`
            "dist/uPlot.min.css",
        ),
    ),
)

REGISTRY = os.environ.get("NPM_REGISTRY", "https://registry.npmjs.org").rstrip("/")
ROOT = Path(__file__).resolve().parents[1]
VENDOR_DIR = ROOT / "dolmus" / "server" / "ui" / "vendor"
MANIFEST = "VENDOR.json"
# Files at the top of vendor/ that are not owned by any package.
TOP_LEVEL_FILES = {MANIFEST, "README.md"}
TIMEOUT_S = 60


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #


def _get(url: str) -> bytes:
    req = urllib.request.Request(url, headers={"User-Agent": "dolmus-vendor-ui/1"})
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
        return resp.read()


def _registry_json(path: str) -> dict:
    return json.loads(_get(f"{REGISTRY}/{path}"))


def _quote_name(name: str) -> str:
    # "@scope/pkg" -> "@scope%2Fpkg"
    return urllib.parse.quote(name, safe="@")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _verify_integrity(data: bytes, integrity: str) -> None:
    # SRI string, possibly several space-separated hashes; we require sha512.
    for item in integrity.split():
        algo, _, digest = item.partition("-")
        if algo == "sha512":
            actual = base64.b64encode(hashlib.sha512(data).digest()).decode()
            if actual != digest:
                raise SystemExit(f"integrity mismatch: expected {item}, got sha512-{actual}")
            return
    raise SystemExit(f"no sha512 in integrity {integrity!r}")


def _spdx(pkg_json: dict) -> str:
    lic = pkg_json.get("license")
    if isinstance(lic, dict):  # legacy {"type": ..., "url": ...}
        lic = lic.get("type")
    if not isinstance(lic, str) or not lic:
        raise SystemExit(f"{pkg_json.get('name')}: no SPDX 'license' in package.json")
    return lic


def _read_members(tar: tarfile.TarFile) -> dict[str, tarfile.TarInfo]:
    """Map 'path/inside/package' -> member (first path component stripped)."""
    out = {}
    for m in tar.getmembers():
        parts = m.name.split("/", 1)
        if len(parts) == 2 and m.isfile():
            out[parts[1]] = m
    return out


# --------------------------------------------------------------------------- #
# vendoring
# --------------------------------------------------------------------------- #


def fetch_package(pkg: Package, vendor_dir: Path) -> dict:
    """Download, verify and extract one package; return its manifest entry."""
    meta = _registry_json(f"{_quote_name(pkg.name)}/{urllib.parse.quote(pkg.version)}")
    if meta.get("name") != pkg.name or meta.get("version") != pkg.version:
        raise SystemExit(
            f"registry returned {meta.get('name')}@{meta.get('version')} for {pkg.name}@{pkg.version}"
        )
    tarball_url = meta["dist"]["tarball"]
    integrity = meta["dist"].get("integrity")
    if not integrity:
        raise SystemExit(f"{pkg.name}@{pkg.version}: registry has no dist.integrity")

    data = _get(tarball_url)
    _verify_integrity(data, integrity)

    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = _read_members(tar)

        def read(rel: str) -> bytes:
            if rel not in members:
                raise SystemExit(f"{pkg.name}@{pkg.version}: {rel} not in tarball")
            f = tar.extractfile(members[rel])
            assert f is not None
            return f.read()

        pkg_json = json.loads(read("package.json"))
        if pkg_json.get("name") != pkg.name or pkg_json.get("version") != pkg.version:
            raise SystemExit(f"{pkg.name}@{pkg.version}: tarball package.json mismatch")
        licence = _spdx(pkg_json)

        wanted = list(pkg.files) + list(pkg.licence_files)
        contents: dict[str, bytes] = {}
        sources: dict[str, str] = {}
        for rel in wanted:
            flat = Path(rel).name
            if flat in contents:
                raise SystemExit(f"{pkg.name}: two files flatten to {flat!r}")
            contents[flat] = read(rel)
            sources[flat] = rel

    # Replace vendor/<dest>/ wholesale so stale files never linger.
    dest = vendor_dir / pkg.dest
    tmp = Path(tempfile.mkdtemp(prefix=f".{pkg.dest}-", dir=vendor_dir))
    try:
        for flat, blob in contents.items():
            (tmp / flat).write_bytes(blob)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)

    return {
        "name": pkg.name,
        "version": pkg.version,
        "license": licence,
        "tarball": tarball_url,
        "integrity": integrity,
        "files": [
            {
                "path": f"{pkg.dest}/{flat}",
                "source": sources[flat],
                "size": len(blob),
                "sha256": _sha256(blob),
            }
            for flat, blob in contents.items()
        ],
    }


def vendor(packages: tuple[Package, ...], vendor_dir: Path) -> dict:
    vendor_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for pkg in packages:
        print(f"vendoring {pkg.name}@{pkg.version} -> {pkg.dest}/", flush=True)
        entries.append(fetch_package(pkg, vendor_dir))
    # Remove directories of packages no longer pinned.
    keep = {p.dest for p in packages}
    for child in vendor_dir.iterdir():
        if child.is_dir() and child.name not in keep and not child.name.startswith("."):
            print(f"removing stale {child.name}/")
            shutil.rmtree(child)
    manifest = {
        "_comment": "Generated by scripts/vendor_ui.py; do not edit. "
        "Verify with: python scripts/vendor_ui.py --check",
        "packages": entries,
    }
    (vendor_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


# --------------------------------------------------------------------------- #
# check
# --------------------------------------------------------------------------- #


def check(vendor_dir: Path, pinned: tuple[Package, ...] | None = PINNED) -> list[str]:
    """Re-hash vendored files against VENDOR.json; return a list of problems.

    Also reports files on disk that the manifest does not list and, unless
    ``pinned`` is None, packages/versions that differ from the pinned table.
    An empty list means everything is consistent.
    """
    vendor_dir = Path(vendor_dir)
    problems: list[str] = []
    manifest_path = vendor_dir / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        packages = manifest["packages"]
    except FileNotFoundError:
        return [f"{manifest_path}: missing"]
    except (ValueError, KeyError, TypeError) as exc:
        return [f"{manifest_path}: unreadable ({exc})"]

    listed: set[str] = set()
    for entry in packages:
        for f in entry.get("files", []):
            rel = f["path"]
            listed.add(rel)
            path = vendor_dir / rel
            if not path.is_file():
                problems.append(f"{rel}: missing")
                continue
            digest = _sha256(path.read_bytes())
            if digest != f["sha256"]:
                problems.append(f"{rel}: sha256 {digest} != recorded {f['sha256']}")

    # Anything on disk that is not in the manifest (e.g. a stray source map).
    for path in sorted(vendor_dir.rglob("*")):
        rel = path.relative_to(vendor_dir).as_posix()
        if path.is_file() and rel not in listed and rel not in TOP_LEVEL_FILES:
            problems.append(f"{rel}: not listed in {MANIFEST}")

    if pinned is not None:
        recorded = {e.get("name"): e.get("version") for e in packages}
        wanted = {p.name: p.version for p in pinned}
        for name in sorted(recorded.keys() | wanted.keys()):
            if recorded.get(name) != wanted.get(name):
                problems.append(
                    f"{name}: {MANIFEST} has {recorded.get(name)}, "
                    f"pinned table has {wanted.get(name)} (re-run the script)"
                )
    return problems


# --------------------------------------------------------------------------- #
# upgrade
# --------------------------------------------------------------------------- #


def upgrade_pins(script: Path = Path(__file__)) -> tuple[Package, ...]:
    """Rewrite PINNED versions in this file to npm's "latest" dist-tag."""
    src = script.read_text(encoding="utf-8")
    bumped = []
    for pkg in PINNED:
        latest = _registry_json(_quote_name(pkg.name))["dist-tags"]["latest"]
        if latest != pkg.version:
            print(f"{pkg.name}: {pkg.version} -> {latest}")
            pattern = re.compile(r'(Package\(\s*"' + re.escape(pkg.name) + r'",\s*")[^"]+(")')
            src, n = pattern.subn(lambda m, v=latest: m.group(1) + v + m.group(2), src, count=1)
            if n != 1:
                raise SystemExit(f"could not find pin for {pkg.name} in {script}")
        else:
            print(f"{pkg.name}: {pkg.version} is latest")
        bumped.append(Package(pkg.name, latest, pkg.dest, pkg.files, pkg.licence_files))
    script.write_text(src, encoding="utf-8")
    return tuple(bumped)


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--check", action="store_true", help="verify files on disk against VENDOR.json (no network)"
    )
    mode.add_argument(
        "--upgrade",
        action="store_true",
        help="bump pinned versions in this script to npm latest, then vendor",
    )
    ap.add_argument("--vendor-dir", type=Path, default=VENDOR_DIR, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.check:
        problems = check(args.vendor_dir)
        for p in problems:
            print(f"ERROR: {p}", file=sys.stderr)
        if problems:
            return 1
        manifest = json.loads((args.vendor_dir / MANIFEST).read_text(encoding="utf-8"))
        n = sum(len(e["files"]) for e in manifest["packages"])
        print(f"OK: {n} files in {len(manifest['packages'])} packages match {MANIFEST}")
        return 0

    packages = upgrade_pins() if args.upgrade else PINNED
    manifest = vendor(packages, args.vendor_dir)
    total = sum(f["size"] for e in manifest["packages"] for f in e["files"])
    print(f"wrote {args.vendor_dir / MANIFEST} ({total} bytes vendored)")
    problems = check(args.vendor_dir, pinned=packages)
    for p in problems:
        print(f"ERROR: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
