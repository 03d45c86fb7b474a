#!/usr/bin/env bash
# `make test`'s two phases (usage: scripts/run_tests.sh PYTHON [pytest args...]; the args go to both phases):
#  1. every test but the `alone` ones on both cores: pytest-xdist, one test file per worker at a time, the longest
#     files first (tests/conftest.py) so that the end is not one long file running by itself (--no-loadscope-reorder:
#     by default xdist hands out the files with the most tests first, which put the one-test chaos soak and demo
#     last, one worker idle for a minute);
#  2. the `alone` tests (they measure times or a CPU share), one at a time, with nothing beside them.
# Exit status: the first failing phase's; 5 ("no tests collected") only when neither phase collected a test.
py=$1
shift
# the suite's budget (tests/conftest.py) counts from here, for both phases and every worker
export CHAINSWARM_SUITE_START="${CHAINSWARM_SUITE_START:-$(date +%s.%N)}"
"$py" -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder -m "not alone" "$@"
first=$?
"$py" -m pytest -m alone "$@"
second=$?
if [ "$first" -eq 5 ] && [ "$second" -eq 5 ]; then
  echo "pytest collected no tests"
  exit 5
fi
[ "$first" -eq 5 ] && first=0
[ "$second" -eq 5 ] && second=0
[ "$first" -ne 0 ] && exit "$first"
exit "$second"
