#!/usr/bin/env bash
# One H200, one call: Megatron-LM core_r0.19.0's own checkpointing and optimizer unit tests on
# upstream megatron-core 0.19.2 and on this build (scripts/device/mlm-unit-tests.sh), side by
# side with the resume benchmark's built-in configurations at --size small and the GPU tests
# (scripts/device/megatron-lm-suite.sh); then the one unit test that fills 60 % of the GPU on
# purpose (test_oom_is_handled), alone, upstream first.
#   bash scripts/device/h200-checks.sh [CONFIG ...]     # default: every built-in configuration
# Results under $OUT: mlm/mlm-unit-tests.tgz, oom/mlm-unit-tests.tgz, suite.tgz.
# Stage first (here): BUILD_PYTHON=python3.12 bash scripts/device/mlm-unit-tests.sh stage, then
# the example plugin's wheel into .gpu/plugin and .gpu/mlm-client/megatron-lm-core_r0.19.0.tar.gz
# (git archive core_r0.19.0 pretrain_gpt.py gpt_builders.py model_provider.py megatron).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/out}
oom=tests/unit_tests/dist_checkpointing/models/test_mlp_glu.py::TestParallelMLPWithGLU::test_oom_is_handled
OUT=$out/mlm RUN_SECONDS=${PHASE_SECONDS:-330} PYTEST_EXTRA="--deselect $oom" \
  bash scripts/device/mlm-unit-tests.sh run > /tmp/mlm-phase.log 2>&1 &
mlm=$!
OUT=$out RUN_SECONDS=${PHASE_SECONDS:-330} GPU_TESTS_SECONDS=${PHASE_SECONDS:-330} \
  bash scripts/device/megatron-lm-suite.sh "$@" \
  > /tmp/suite-phase.log 2>&1 &
suite=$!
wait "$mlm"
echo "unit tests: exit $?"
wait "$suite"
echo "suite: exit $?"
OUT=$out/oom WORK=/tmp/mlm-unit-oom SEQUENTIAL=1 TEST_TIMEOUT=100 RUN_SECONDS=210 \
  MLM_TESTS=${oom%%::*} PYTEST_EXTRA="-k test_oom_is_handled" \
  bash scripts/device/mlm-unit-tests.sh run > /tmp/oom-phase.log 2>&1
echo "test_oom_is_handled: exit $?"
tail -4 /tmp/mlm-phase.log /tmp/suite-phase.log /tmp/oom-phase.log
