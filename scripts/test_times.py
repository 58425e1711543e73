"""Prints each test module's time from a pytest JUnit report, slowest first, as docs/architecture.md shows it.

    ./scripts/test.sh --junitxml=report.xml && .venv/bin/python scripts/test_times.py report.xml

A module's time is the sum of its tests' (set-up and shared launches included), on whichever worker ran it.
"""

import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict

seconds: dict[str, float] = defaultdict(float)
tests: dict[str, int] = defaultdict(int)
for case in ElementTree.parse(sys.argv[1]).iter("testcase"):
    module = case.get("classname", "").split("::")[0]
    path = module.replace(".", "/") + ".py"
    if case.find("skipped") is None:
        seconds[path] += float(case.get("time", 0))
        tests[path] += 1

print("| module | tests | seconds |")
print("| --- | ---: | ---: |")
for path in sorted(seconds, key=seconds.get, reverse=True):
    print(f"| `{path}` | {tests[path]} | {seconds[path]:.0f} |")
print(f"| all | {sum(tests.values())} | {sum(seconds.values()):.0f} |")
