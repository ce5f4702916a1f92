"""Check that every test ran in some pass of CI: print where each test file ran, exit 1 for a test that ran nowhere.

Each pass of ``.ci/run`` sets ``MPIDOMAIN_TEST_RECORD=<folder>/<pass>.jsonl``; the suite's rank 0 writes there what
it collected and how each selected test ended (tests/conftest.py). A test collected in some pass that no pass
selected, or that every pass skipped for a reason other than missing hardware (a GPU, CuPy) or a world with more
divisors than CI's, fails the check.

    python scripts/ci/test_coverage.py RECORD_FOLDER
"""

import collections
import glob
import json
import os
import re
import sys

# Skips that no CI machine can lift: no GPU, no CuPy, no CUDA-aware MPI (the GPU checks: scripts/ci/gpu_check.sh),
# or a case for a world with more divisors than CI's worlds have (the 8-rank jobs check those layouts).
UNLIFTABLE = re.compile(r"GPU|CUDA|[Cc]u[Pp]y|NCCL|world of \d+ has only \d+ divisors")


def main(folder):
    collected, ran, skipped = set(), collections.defaultdict(set), collections.defaultdict(set)
    passes = sorted(glob.glob(os.path.join(folder, "*.jsonl")))
    if not passes:
        print(f"test coverage: no records in {folder}", file=sys.stderr)
        return 1
    for path in passes:
        name = os.path.splitext(os.path.basename(path))[0]
        with open(path) as file:
            for row in map(json.loads, file):
                if row["event"] == "collected":
                    collected.add(row["test"])
                elif row["event"] == "skipped":
                    skipped[row["test"]].add(row.get("reason", ""))
                else:
                    ran[row["test"]].add(name)
    nowhere = sorted(t for t in collected if t not in ran and t not in skipped)
    only_skipped = sorted(t for t in collected if t not in ran and t in skipped
                          and not all(UNLIFTABLE.search(reason) for reason in skipped[t]))
    by_file = collections.defaultdict(collections.Counter)
    for test, names in ran.items():
        for name in names:
            by_file[test.split("::")[0]][name] += 1
    print(f"test coverage: {len(collected)} tests collected over {len(passes)} passes; tests run per file and pass:")
    for path in sorted(by_file):
        print(f"  {path}: " + ", ".join(f"{name} {count}" for name, count in sorted(by_file[path].items())))
    unliftable = sorted(t for t in collected if t not in ran and t in skipped and t not in only_skipped)
    print(f"test coverage: {len(unliftable)} tests skipped in every pass for want of a GPU, CuPy or a larger world:")
    for test in unliftable:
        print(f"  {test}: {'; '.join(sorted(skipped[test]))[:200]}")
    for test in nowhere:
        print(f"  selected by no pass: {test}")
    for test in only_skipped:
        print(f"  skipped in every pass: {test}: {'; '.join(sorted(skipped[test]))[:300]}")
    if nowhere or only_skipped:
        print(f"test coverage: {len(nowhere) + len(only_skipped)} tests ran in no pass of .ci/run; select each in "
              "a pass (.ci/run, docs/testing.md)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: python scripts/ci/test_coverage.py RECORD_FOLDER")
    sys.exit(main(sys.argv[1]))
