package pgtier

// HistoryQuery is historyQuery, for tests that run it on a connection of
// their choice.
const HistoryQuery = historyQuery
