# session 13, chain call 2 (same warm machine), carry [".stage-b", ".gpu"]:
#   source .stage-b/use.sh && LANE_S=540 bash configs/h200/s13-call2.sh
# the GPU lane with the short GPU bench: configs/h200/s11-call3.sh, unchanged (what this file held when it ran).
exec bash "$(dirname "$0")/s11-call3.sh"
