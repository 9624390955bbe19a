//! Helpers for specd's end-to-end tests.
