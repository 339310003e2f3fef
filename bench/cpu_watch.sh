# CPU watch shared by the bench scripts (sourced): busy_percent, the idle check before a run, a
# monitor of the CPU other processes use meanwhile, and foreign_since MARK (the share of it since a
# mark: `mark=$(cat "$work/foreign" 2>/dev/null || echo "0 0")`). Needs $work and BENCH_NAME set.
busy_percent() {
  local a b
  read -r -a a < <(head -n 1 /proc/stat)
  sleep 2
  read -r -a b < <(head -n 1 /proc/stat)
  local total=0 idle=$(( (b[4] + b[5]) - (a[4] + a[5]) ))
  for i in 1 2 3 4 5 6 7 8; do total=$((total + b[i] - a[i])); done
  echo $(( total > 0 ? 100 * (total - idle) / total : 0 ))
}
busy_before=$(busy_percent)
[ "$busy_before" -lt 10 ] || echo "$BENCH_NAME: warning: the CPUs were $busy_before% busy before the run; other work skews the figures" >&2

# Watches, every second, the CPU that processes outside this script's process group use (a build or
# a test run started meanwhile) and keeps "foreign_ticks elapsed_ticks" (cumulative) in $work/foreign.
/usr/bin/python3 - "$work/foreign" "$(ps -o pgid= $$ | tr -d ' ')" <<'PY' &
import os, sys, time
out, pgid = sys.argv[1], int(sys.argv[2])
hz, cores = os.sysconf("SC_CLK_TCK"), os.cpu_count()
def sample():
    ticks = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) != pgid:  # fields[2]: pgrp
            ticks[pid] = int(fields[11]) + int(fields[12])
    return ticks
start, prev, foreign = time.monotonic(), sample(), 0
while True:
    time.sleep(1)
    now = sample()
    foreign += sum(max(0, t - prev.get(pid, t)) for pid, t in now.items())
    prev = now
    with open(out + ".tmp", "w") as f:
        f.write(f"{foreign} {int((time.monotonic() - start) * hz * cores)}\n")
    os.replace(out + ".tmp", out)
PY
monitor_pid=$!

# Share (percent) of the machine's CPU that other processes used since MARK ("foreign elapsed").
foreign_since() {
  local now
  now=$(cat "$work/foreign" 2>/dev/null || echo "0 0")
  /usr/bin/python3 -c "
a, b = [int(x) for x in '$1'.split()], [int(x) for x in '$now'.split()]
print(f'{100 * (b[0] - a[0]) / max(1, b[1] - a[1]):.0f}')"
}
