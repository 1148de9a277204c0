package guardtest

// OddEventIDs are event IDs real producers send that a narrow charset would
// refuse; tests send each one through every tier. Each is valid
// under guard.ValidateID.
var OddEventIDs = []string{
	"order#1", "a/b", "tenant|42", "{6f1c1e1a-3b7e-4c9a-9f7e-2d1b8c0e5a11}",
	"a:b:c", "100%", `quote"and\backslash`, "with space", "заказ-№7", "注文-1", "😀-emoji",
	"*?[]{}", "'; DROP TABLE idem_processed; --",
}
