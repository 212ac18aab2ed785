"""A dataset's checksums (``meta/checksums.json``): the size and SHA-256 of every file of a dataset the project
writes (:func:`slurmvla.data.writer.write_dataset`: the sample data, the simulator's demonstrations), each file
checked on its first read in a process (:func:`verify`).

A byte flipped or zeroed inside a compressed video packet or parquet page often decodes without any error, to other
pixels or values: only a checksum tells that file from the one written. A file whose size or digest differs from
its entry is a :class:`~slurmvla.data.DataError` naming it, met where the file is opened: its episodes are skipped
under ``data.on_damaged=skip`` (a metadata file's damage stops the start-up, naming it) and no sample of it is
delivered as good. A dataset without the file (LeRobot's own, DROID's port) is read as before: damage there is
found only where it breaks the decoding (``python -m slurmvla.inspect --scan`` decodes every file). A file edited
on purpose after writing is refused the same way; :func:`write_checksums` records the dataset as it now is.

A file is hashed once per process (again if its size, modification time or inode changes): about 1 s per GB.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from slurmvla.data import DataError

FILE = "meta/checksums.json"
ALGORITHM = "sha256"
_BLOCK = 1 << 20

# Per process: each directory's checksums (the nearest meta/checksums.json at or above it, None where there is
# none), each manifest as read, and the files found intact.
_LOCK = threading.Lock()
_manifest_of_dir: dict[str, Path | None] = {}
_manifests: dict[tuple[str, int, int], dict[str, dict]] = {}
_intact: set[tuple[str, int, int, int]] = set()


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def write_checksums(root: str | Path) -> Path:
    """``root/meta/checksums.json``: every file under ``root`` (but itself) with its size and SHA-256."""
    root = Path(root)
    manifest = root / FILE
    files = sorted(p for p in root.rglob("*") if p.is_file() and p != manifest)
    entries = {p.relative_to(root).as_posix(): {"bytes": p.stat().st_size, ALGORITHM: digest(p)} for p in files}
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"algorithm": ALGORITHM, "files": entries}, indent=1) + "\n")
    return manifest


def _find_manifest(directory: str) -> Path | None:
    """The checksums file of the dataset ``directory`` belongs to: the nearest ``meta/checksums.json`` at or above it."""
    walked = []
    found = None
    d = directory
    while True:
        if d in _manifest_of_dir:
            found = _manifest_of_dir[d]
            break
        walked.append(d)
        candidate = os.path.join(d, FILE)
        if os.path.isfile(candidate):
            found = Path(candidate)
            break
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    for w in walked:
        _manifest_of_dir[w] = found
    return found


def _entries(manifest: Path) -> dict[str, dict]:
    """The manifest's entries, read once per version of the file; a manifest that is not one names itself."""
    st = manifest.stat()
    key = (str(manifest), st.st_size, st.st_mtime_ns)
    if key in _manifests:
        return _manifests[key]
    try:
        raw = json.loads(manifest.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{manifest} is not JSON ({e}): the dataset's checksums file is damaged", manifest) from None
    files = raw.get("files") if isinstance(raw, dict) else None
    if not isinstance(files, dict) or raw.get("algorithm") != ALGORITHM:
        raise DataError(f"{manifest} is not a checksums file (expected {{'algorithm': '{ALGORITHM}', 'files': "
                        "{path: {bytes, sha256}}}): the dataset's checksums file is damaged", manifest)
    _manifests[key] = files
    return files


def require_listed(root: str | Path, prefix: str = "meta/") -> None:
    """Every file the dataset's checksums list under ``prefix`` (its metadata, by default) exists: a missing one
    is a :class:`DataError` naming it (metadata files are found by globbing; one missing would lose its episodes
    without a word)."""
    manifest = Path(root) / FILE
    if not manifest.is_file():
        return
    for rel in _entries(manifest):
        if rel.startswith(prefix) and not (Path(root) / rel).is_file():
            raise DataError(f"{Path(root) / rel} does not exist, but the dataset's checksums ({manifest}) list it: an "
                            "incomplete copy?", Path(root) / rel)


def verify(path: str | Path) -> None:
    """Nothing when ``path`` is not in a dataset with checksums, is not listed there, or is as written; else a
    :class:`DataError` naming it. A missing file raises ``FileNotFoundError`` (the caller says what it is)."""
    path = os.path.abspath(path)
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns, st.st_ino)
    if key in _intact:
        return
    with _LOCK:
        manifest = _find_manifest(os.path.dirname(path))
    if manifest is None:
        return
    root = manifest.parent.parent
    entry = _entries(manifest).get(Path(path).relative_to(root).as_posix())
    if entry is None:
        return
    if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) or not isinstance(entry.get(ALGORITHM), str):
        raise DataError(f"{path}: its entry in {manifest} is not {{bytes, {ALGORITHM}}}: the dataset's checksums file "
                        "is damaged", path)
    on_purpose = "(edited on purpose: slurmvla.data.checksums.write_checksums records the dataset anew)"
    if st.st_size != entry["bytes"]:
        raise DataError(f"{path} has {st.st_size} bytes, {entry['bytes']} when written ({manifest}): the file is "
                        f"damaged or incomplete {on_purpose}", path)
    if digest(Path(path)) != entry[ALGORITHM]:
        raise DataError(f"{path}: its content differs from the {ALGORITHM} it was written with ({manifest}): the file "
                        f"is damaged {on_purpose}", path)
    with _LOCK:
        _intact.add(key)
