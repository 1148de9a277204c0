package guard_test

import (
	"fmt"

	"github.com/idemhq/idem/pkg/guard"
)

func ExampleValidateID() {
	fmt.Println(guard.ValidateID("evt_12345"))
	fmt.Println(guard.ValidateID("evt 12345"))
	// Output:
	// <nil>
	// invalid event id: byte 3 (' ') is outside [A-Za-z0-9_.:-]
}

func ExampleOutcome_String() {
	for _, o := range guard.Outcomes() {
		fmt.Println(o)
	}
	// Output:
	// processed
	// duplicate_redis
	// duplicate_postgres
	// payload_conflict
	// retry
	// dead_lettered
}
