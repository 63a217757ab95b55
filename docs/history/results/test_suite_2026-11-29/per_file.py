"""Seconds per test file (the sum of its tests' setup, call and teardown) from pytest's JUnit XML files.

    python per_file.py before.xml [before-device.xml] -- after.xml
"""
import collections
import sys
import xml.etree.ElementTree as ET


def per_file(paths):
    seconds, count = collections.Counter(), collections.Counter()
    for path in paths:
        for case in ET.parse(path).iter("testcase"):
            name = case.get("classname").split(".")[-1] + ".py"
            seconds[name] += float(case.get("time"))
            count[name] += 1
    return seconds, count


split = sys.argv.index("--")
(before, nb), (after, na) = per_file(sys.argv[1:split]), per_file(sys.argv[split + 1:])
print(f"| file | tests before | s before | tests after | s after | after/before |\n|---|---|---|---|---|---|")
for name in sorted(set(before) | set(after), key=lambda n: -before.get(n, 0)):
    b, a = before.get(name, 0.0), after.get(name, 0.0)
    print(f"| {name} | {nb.get(name, 0)} | {b:.1f} | {na.get(name, 0)} | {a:.1f} | {a / b:.2f} |" if b else
          f"| {name} | 0 | - | {na.get(name, 0)} | {a:.1f} | new |")
print(f"| **all** | {sum(nb.values())} | {sum(before.values()):.1f} | {sum(na.values())} | {sum(after.values()):.1f} | "
      f"{sum(after.values()) / sum(before.values()):.2f} |")
