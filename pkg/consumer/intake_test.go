package consumer

import (
	"math/rand/v2"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
)

// TestIntakeQueueHandsOverEveryDeliveryInOrder: deliveries pushed while
// they are taken in chunks of any size come out once each, in the broker's
// order, and the end is seen only after the last of them.
func TestIntakeQueueHandsOverEveryDeliveryInOrder(t *testing.T) {
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 2))
		const n = 5000
		q := &intakeQueue{ready: make(chan struct{}, 1)}
		go func() {
			for tag := uint64(1); tag <= n; tag++ {
				q.push(amqp.Delivery{DeliveryTag: tag})
			}
			q.close(false)
		}()
		var got []amqp.Delivery
		for end := false; !end; {
			<-q.ready
			var batch []amqp.Delivery
			batch, end = q.take(nil, 1+rng.IntN(7))
			got = append(got, batch...)
		}
		require.Len(t, got, n, "seed %d", seed)
		for i, d := range got {
			require.Equal(t, uint64(i+1), d.DeliveryTag, "seed %d", seed)
		}
	}
}

// TestIntakeQueueDropsWhatItHoldsWhenTheChannelIsGone: closed with drop,
// the queue ends at once, with nothing to take.
func TestIntakeQueueDropsWhatItHoldsWhenTheChannelIsGone(t *testing.T) {
	q := &intakeQueue{ready: make(chan struct{}, 1)}
	for tag := uint64(1); tag <= 3; tag++ {
		q.push(amqp.Delivery{DeliveryTag: tag})
	}
	got, end := q.take(nil, 1)
	require.False(t, end)
	require.Len(t, got, 1)
	q.close(true)
	<-q.ready
	got, end = q.take(nil, 10)
	require.True(t, end)
	require.Empty(t, got)
}
