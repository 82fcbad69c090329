"""Hand-written fakes for the seams where the real thing is not the point of a test."""
