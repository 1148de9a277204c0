// Package guard makes an event handler effectively once on top of an
// at-least-once delivery.
//
// A Guard runs every event through two tiers. The fast tier (Redis, see
// package redistier) drops most duplicates with one round trip, but it is only
// an optimisation: it may be down, flushed or evicting. The authoritative tier
// (PostgreSQL, see package pgtier) inserts a dedup row in the same transaction
// as the handler's effect, so the row and the effect commit or roll back
// together. Only that row decides that an event was processed.
//
// The flow, and what a crash at each step leads to, is documented in
// docs/guard.md; the Step constants name the points between the steps.
package guard
