"""The benchmarks live beside the package, not in it: make them importable.

pytest's default import mode puts only the test's own directory on sys.path,
so ``import benchmarks`` needs the repository root there too.
"""

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
