package partition_test

import (
	"fmt"
	"hash/fnv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/pkg/partition"
)

// TestOfIsFNV1aModN pins the function: a change would route keys to other
// shards than the ones holding their history.
func TestOfIsFNV1aModN(t *testing.T) {
	for i := range 1000 {
		key := fmt.Sprintf("user_%d", i)
		h := fnv.New64a()
		h.Write([]byte(key))
		for _, n := range []int{2, 3, 8, 12} {
			require.Equal(t, int(h.Sum64()%uint64(n)), partition.Of(key, n))
		}
	}
	require.Equal(t, 0, partition.Of("anything", 1))
	require.Equal(t, 0, partition.Of("anything", 0))
}

// TestShardsThatDividePartitionsAlign checks the property the docs promise:
// with shards dividing partitions, a partition's keys all map to one shard.
func TestShardsThatDividePartitionsAlign(t *testing.T) {
	const partitions, shards = 12, 3
	for i := range 10000 {
		key := fmt.Sprintf("user_%d", i)
		require.Equal(t, partition.Of(key, partitions)%shards, partition.Of(key, shards), key)
	}
}

func ExampleOf() {
	fmt.Println(partition.Of("user_42", 8), partition.Of("user_42", 2))
	// Output: 1 1
}
