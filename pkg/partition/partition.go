// Package partition maps a key (a payment's userId, say) to one of n
// partitions. idem uses the one function for both places a key is routed:
// the queue partition `idem publish` sends an event to, and the Postgres
// shard that holds its dedup row and its effects. When the number of shards
// divides the number of partitions, every event of a partition lands on one
// shard (partition p on shard p mod shards), so one consumer's batch touches
// one shard.
package partition

// Of returns the partition of key among n (0 ≤ Of < n): FNV-1a (64 bits)
// of the key's bytes, modulo n. It is stable across processes, versions and
// machines; changing it, or n, moves keys, which for shards is a data
// migration. n below 2 gives 0.
func Of(key string, n int) int {
	if n < 2 {
		return 0
	}
	const (
		offset = 14695981039346656037
		prime  = 1099511628211
	)
	h := uint64(offset)
	for i := 0; i < len(key); i++ {
		h ^= uint64(key[i])
		h *= prime
	}
	return int(h % uint64(n))
}
