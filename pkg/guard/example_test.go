package guard_test

import (
	"fmt"

	"github.com/idemhq/idem/pkg/guard"
)

func ExampleValidateID() {
	fmt.Println(guard.ValidateID("evt_12345"))
	fmt.Println(guard.ValidateID("order#1/{tenant|42}"))
	fmt.Println(guard.ValidateID("evt\t12345"))
	fmt.Println(guard.ValidateID("acct\xff"))
	// Output:
	// <nil>
	// <nil>
	// invalid event id: unprintable character U+0009 at byte 3
	// invalid event id: invalid UTF-8 or U+FFFD at byte 4
}

func ExampleOutcome_String() {
	for _, o := range guard.Outcomes() {
		fmt.Println(o)
	}
	// Output:
	// processed
	// duplicate_redis
	// duplicate_postgres
	// duplicate_batch
	// payload_conflict
	// retry
	// dead_lettered
}
