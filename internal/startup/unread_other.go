//go:build !linux

package startup

import "net"

// unread cannot tell here; the grace alone protects a connection.
func unread(net.Conn) bool { return false }
