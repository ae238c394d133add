#!/bin/bash
# CPU seconds of a whole process tree: bench/cpu_of.sh NAME CMD... runs CMD in a cgroup-v1 cpuacct
# group of its own (root, /sys/fs/cgroup/cpuacct mounted) and prints wall and CPU seconds. The
# comparison that survives a loaded host (BENCHMARKS.md, "CI time: the tests' JVMs with C1 alone").
name=$1; shift
cg=/sys/fs/cgroup/cpuacct/$name
rmdir $cg 2>/dev/null; mkdir -p $cg
echo $$ > $cg/cgroup.procs
start=$(date +%s.%N)
"$@"; rc=$?
end=$(date +%s.%N)
echo $$ > /sys/fs/cgroup/cpuacct/cgroup.procs
u=$(cat $cg/cpuacct.usage)
echo "CPUOF $name rc=$rc wall=$(echo "$end - $start" | bc) cpu=$(echo "scale=1; $u/1000000000" | bc) $(tr '\n' ' ' < $cg/cpuacct.stat)" 
