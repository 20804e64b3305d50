"""Check what the sdist and the wheel hold: python .ci/check_dist.py SDIST WHEEL

Every source the build needs (csrc/*.pyx, *.pxi, *.pxd, *.h, setup.py, pyproject.toml)
and every module of the package must be there, with the typing files (py.typed, the
_core.pyi stubs), the README and the LICENSE; generated C and built extensions must not
be in the sdist.  Expected files are read off the checkout, so a new module or .pxi that
the packaging misses fails CI.
"""
from __future__ import annotations

import email.parser
import fnmatch
import glob
import os
import sys
import tarfile
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout(*patterns: str) -> set[str]:
    found = set()
    for pattern in patterns:
        for path in glob.glob(os.path.join(REPO, pattern)):
            found.add(os.path.relpath(path, REPO).replace(os.sep, "/"))
    return found


def main(sdist: str, wheel: str) -> int:
    errors = []
    package = (checkout("mxload/*.py", "mxload/*/*.py", "mxload/*/*/*.py")
               | {"mxload/py.typed", "mxload/_core.pyi"})

    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    root = names[0].split("/")[0]
    in_sdist = {n[len(root) + 1:] for n in names if n.startswith(root + "/")}
    want = (package | checkout("csrc/*.pyx", "csrc/*.pxi", "csrc/*.pxd", "csrc/mxload/*.pxd", "csrc/*.h",
                       "tests/*.py")
            | {"setup.py", "pyproject.toml", "README.md", "LICENSE", "PKG-INFO"})
    errors += [f"sdist lacks {name}" for name in sorted(want - in_sdist)]
    for pattern in ("csrc/*.c", "*.so", "*.pyd", "*.pyc"):
        errors += [f"sdist ships generated/built file {name}"
                   for name in sorted(fnmatch.filter(in_sdist, pattern))]

    with zipfile.ZipFile(wheel) as whl:
        in_wheel = set(whl.namelist())
        metadata_name = next(n for n in in_wheel if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(whl.read(metadata_name).decode())
    errors += [f"wheel lacks {name}" for name in sorted(package - in_wheel)]
    if not fnmatch.filter(in_wheel, "mxload/_core.*.so") + fnmatch.filter(in_wheel, "mxload/_core.*.pyd"):
        errors.append("wheel lacks the compiled core mxload/_core.*.so")
    if not fnmatch.filter(in_wheel, "*.dist-info/licenses/LICENSE"):
        errors.append("wheel lacks the LICENSE")
    if any(name.startswith(("tests/", "csrc/", "bench/")) for name in in_wheel):
        errors.append("wheel ships tests/, csrc/ or bench/")
    expected_metadata = {
        "Requires-Python": ">=3.11",
        "License-Expression": "Apache-2.0",
    }
    for key, value in expected_metadata.items():
        if metadata.get(key) != value:
            errors.append(f"wheel METADATA {key} is {metadata.get(key)!r}, expected {value!r}")
    requires = metadata.get_all("Requires-Dist") or []
    runtime = [r for r in requires if "extra ==" not in r]
    if runtime != ["numpy>=1.23"]:
        errors.append(f"runtime dependencies are {runtime}, expected numpy>=1.23 only")

    for error in errors:
        print("check_dist:", error, file=sys.stderr)
    if errors:
        return 1
    print(f"check_dist: sdist ({len(in_sdist)} files) and wheel ({len(in_wheel)} files) hold what they must")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
