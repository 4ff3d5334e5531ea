#!/usr/bin/env bash
# The main job on the hackable demo task: launch/demo.sh with DEMO_FAMILY=hackable (see there).
# Usage: bash launch/demo_hackable.sh [OUT_DIR] [extra overrides for hpa train...]
DEMO_FAMILY=hackable exec bash "$(dirname "$0")/demo.sh" "$@"
