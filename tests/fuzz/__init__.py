"""The differential fuzzer: both backends in lockstep, hostile inputs included.

* ``test_fuzz.py``: the tests; they draw programs of calls and check each in the child.
* ``hostile.py``: the recipes for the values (valid and hostile) the calls take.
* ``child.py``: the child process that runs a program on both backends and compares them;
  ``python tests/fuzz/child.py --replay PROGRAM.json`` replays a failure.
"""
