package bench

import (
	"bufio"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// clockTicks is USER_HZ, the unit of utime and stime in /proc/<pid>/stat: 100
// on every Linux architecture Go supports.
const clockTicks = 100

// Tier names the processes whose CPU a row is charged.
type Tier string

const (
	TierConsumer Tier = "consumer"
	TierPostgres Tier = "postgres"
	TierRabbitMQ Tier = "rabbitmq"
	TierRedis    Tier = "redis"
)

// serviceOf maps a process name (comm) to the service it belongs to.
func serviceOf(comm string) (Tier, bool) {
	switch {
	case comm == "postgres" || strings.HasPrefix(comm, "postgres:"):
		return TierPostgres, true
	case comm == "beam.smp" || comm == "erl_child_setup" || comm == "inet_gethost" || comm == "epmd":
		return TierRabbitMQ, true
	case comm == "redis-server":
		return TierRedis, true
	}
	return "", false
}

// cpuSample is CPU seconds consumed so far, per process.
type cpuSample map[int]float64

// sampleCPU reads the CPU time of every service process and of the given
// consumer pids.
func sampleCPU(consumers []int) (map[Tier]cpuSample, error) {
	out := map[Tier]cpuSample{TierConsumer: {}, TierPostgres: {}, TierRabbitMQ: {}, TierRedis: {}}
	for _, pid := range consumers {
		if _, secs, ok := readStat(pid); ok {
			out[TierConsumer][pid] = secs
		}
	}
	dirs, err := filepath.Glob("/proc/[0-9]*")
	if err != nil {
		return nil, err
	}
	for _, d := range dirs {
		pid, err := strconv.Atoi(filepath.Base(d))
		if err != nil {
			continue
		}
		comm, secs, ok := readStat(pid)
		if !ok {
			continue
		}
		if tier, ok := serviceOf(comm); ok {
			out[tier][pid] = secs
		}
	}
	return out, nil
}

// readStat returns a process's name and its user+system CPU seconds.
func readStat(pid int) (string, float64, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return "", 0, false
	}
	s := string(b)
	open, closing := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 0 || closing < open {
		return "", 0, false
	}
	comm := s[open+1 : closing]
	f := strings.Fields(s[closing+1:])
	// After the name: state is field 3 of the file, utime 14, stime 15.
	if len(f) < 13 {
		return "", 0, false
	}
	ut, err1 := strconv.ParseFloat(f[11], 64)
	st, err2 := strconv.ParseFloat(f[12], 64)
	if err1 != nil || err2 != nil {
		return "", 0, false
	}
	return comm, (ut + st) / clockTicks, true
}

// cpuDelta is the CPU seconds each tier used between two samples. A process
// that started in between counts from zero.
func cpuDelta(before, after map[Tier]cpuSample) map[Tier]float64 {
	out := map[Tier]float64{}
	for tier, procs := range after {
		for pid, secs := range procs {
			out[tier] += secs - before[tier][pid]
		}
	}
	return out
}

// peakRSS returns a process's peak resident set (VmHWM), in bytes.
func peakRSS(pid int) int64 {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				return 0
			}
			return kb * 1024
		}
	}
	return 0
}

// waitQuiet waits until the machine has been nearly idle (under 10% busy)
// for 300ms, or for at most limit: a run must not start while the services
// still work off the one before (a queue being deleted, a checkpoint's
// writes).
func waitQuiet(limit time.Duration) {
	deadline := time.Now().Add(limit)
	for time.Now().Before(deadline) {
		busy1, total1, err1 := cpuTotals()
		time.Sleep(300 * time.Millisecond)
		busy2, total2, err2 := cpuTotals()
		if err1 != nil || err2 != nil || total2 <= total1 {
			return
		}
		if float64(busy2-busy1)/float64(total2-total1) < 0.10 {
			return
		}
	}
}

// cpuTotals reads the machine's busy and total jiffies from /proc/stat.
func cpuTotals() (busy, total uint64, err error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 5 || f[0] != "cpu" {
		return 0, 0, errors.New("/proc/stat: no cpu line")
	}
	for i, s := range f[1:] {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			return 0, 0, err
		}
		total += n
		if i != 3 && i != 4 { // idle and iowait
			busy += n
		}
	}
	return busy, total, nil
}
