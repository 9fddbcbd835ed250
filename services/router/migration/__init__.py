"""Request migration: a stream whose engine fails mid-way is resumed on another engine and spliced."""
