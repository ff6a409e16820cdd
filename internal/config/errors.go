package config

import (
	"errors"
	"fmt"
)

// Error is invalid configuration: the worker exits 78 on it. Msg says what
// is wrong in the operator's terms (the key or variable); Err keeps the
// cause for errors.Is and errors.As.
type Error struct {
	Msg string
	Err error
}

func (e *Error) Error() string { return "invalid configuration: " + e.Msg }
func (e *Error) Unwrap() error { return e.Err }

// Errorf builds an Error; a %w verb keeps the cause.
func Errorf(format string, a ...any) error {
	err := fmt.Errorf(format, a...)
	return &Error{Msg: err.Error(), Err: errors.Unwrap(err)}
}
