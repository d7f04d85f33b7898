"""The benchmark scenarios: ``NAME.py`` defines ``SCENARIO`` (see ``harness/scenario.py``); ``_*.py`` are
helpers several scenarios share."""
