//go:build !linux

package opsserver

import (
	"net"
)

// unread cannot tell here; the grace alone protects a connection.
func unread(net.Conn) bool { return false }
