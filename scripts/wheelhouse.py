"""Fill a wheelhouse with exactly what `pip install REQUIREMENT...` needs on the image's Python.

    python scripts/wheelhouse.py DIR PYTHON_VERSION REQUIREMENT... [-- PIP_OPTION...]

pip resolves with this machine's pip configuration (where torch's CPU build lies) into
DIR.partial, which replaces DIR when complete. `pip download --python-version` evaluates
`python_version` markers for the target but `python_full_version` ones for the running
interpreter: redis needs async-timeout below Python 3.11.3, so Debian's 3.11.2 needs it and
this machine's 3.11.7 would not fetch it. So after pip's pass, every wheel's requirements are
evaluated for the target's full version (with the extras asked of that wheel), and whatever
is missing is downloaded too, until nothing is.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename


def download(dest: Path, python: str, requirements: list[str], options: list[str]) -> None:
    """pip download into DEST; a failure ends the script with pip's own message above."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
         "--python-version", python, "--dest", str(dest), *options, *requirements])
    if done.returncode != 0:
        sys.exit(f"wheelhouse: pip download {' '.join(requirements)} failed "
                 f"(exit {done.returncode}; pip says why above)")


def pinned(folder: Path) -> Path:
    """A constraints file of the wheels in FOLDER (name==version), so that a second pass
    adds what is missing without a second version of anything already there."""
    path = folder.parent / (folder.name + ".constraints.txt")
    path.write_text("".join(f"{name}=={version}\n"
                            for name, (_, version) in sorted(wheels(folder).items())))
    return path


def wheels(folder: Path) -> dict[str, tuple[Path, str]]:
    """canonical name -> (wheel, version); two versions of one project are an error (the
    image's `pip install DIR/*.whl` would refuse them)."""
    found: dict[str, tuple[Path, str]] = {}
    for wheel in sorted(folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if name in found and found[name][1] != str(version):
            sys.exit(f"wheelhouse: two versions of {name} in {folder}: "
                     f"{found[name][0].name} and {wheel.name}")
        found[name] = (wheel, str(version))
    return found


def requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        # the wheel's own top-level .dist-info (some wheels vendor others' deeper down)
        (meta,) = [n for n in z.namelist()
                   if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        headers = HeaderParser().parsestr(z.read(meta).decode())
    return [Requirement(r) for r in headers.get_all("Requires-Dist") or []]


def missing(folder: Path, python: str, roots: list[str]) -> list[str]:
    """Requirements, for the target Python, that no wheel in FOLDER satisfies."""
    env = default_environment()
    env.update(python_full_version=python, python_version=".".join(python.split(".")[:2]))
    have = wheels(folder)
    wanted = [Requirement(r) for r in roots if not r.startswith("-")]
    seen: set[tuple[str, frozenset[str]]] = set()
    lacking = []
    while wanted:
        req = wanted.pop()
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        if name not in have or not req.specifier.contains(have[name][1], prereleases=True):
            lacking.append(str(req).split(";")[0])
            continue
        for dep in requires(have[name][0]):
            extras = req.extras or {""}
            if dep.marker is None or any(dep.marker.evaluate({**env, "extra": e})
                                         for e in extras):
                wanted.append(dep)
    return lacking


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        sys.exit(__doc__)
    folder, python, rest = Path(argv[0]), argv[1], argv[2:]
    requirements, options = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) \
        if "--" in rest else (rest, [])
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    # requirements given as local wheel files are resolved from their folder
    options = [*options, *(f"--find-links={Path(r.split('[')[0]).parent}"
                           for r in requirements if r.split("[")[0].endswith(".whl"))]
    download(partial, python, requirements, options)
    roots = [f"{parse_wheel_filename(Path(r.split('[')[0]).name)[0]}"
             f"{'[' + r.split('[')[1] if '[' in r else ''}" if r.split("[")[0].endswith(".whl")
             else r for r in requirements]
    for _ in range(10):
        lacking = missing(partial, python, roots)
        if not lacking:
            break
        print(f"wheelhouse: for Python {python} also {', '.join(lacking)}", file=sys.stderr)
        download(partial, python, lacking, [*options, "--constraint", str(pinned(partial))])
    else:
        sys.exit(f"wheelhouse: still missing for Python {python}: {', '.join(lacking)}")
    shutil.rmtree(folder, ignore_errors=True)
    partial.with_name(partial.name + ".constraints.txt").unlink(missing_ok=True)
    partial.rename(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
