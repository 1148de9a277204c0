// Package redistier is the guard's fast tier on Redis: a lease table that
// drops most duplicates with one round trip.
//
// A claim is SET key pending:<token> NX PX <lease> GET. The old value tells
// the caller what it found: nothing (lease acquired), done:<hash> (the event
// committed before), or pending:<token> (another consumer holds it). The done
// marker is written only after the Postgres commit. Every call runs under a
// short deadline and through a circuit breaker; any fault makes the answer
// FastSkipped so the event goes to the authoritative tier. Redis losing keys
// (flush, eviction, restart) costs a trip to Postgres, never a double.
package redistier
