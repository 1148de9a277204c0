package broker

// HeaderFrameSize exposes headerFrameSize to the tests.
var HeaderFrameSize = headerFrameSize
