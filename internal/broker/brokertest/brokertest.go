// Package brokertest holds what the broker packages' tests share: the
// attribute values each binding must carry unchanged. Only _test.go files
// import it.
package brokertest

import "github.com/worker-dev/worker/internal/broker"

// Odd are CloudEvents attributes every binding must carry unchanged: the
// escape characters of every binding and name rule ('.', '$', '%', '_',
// ':', '*', '>'), what percent-encoding produces ("%2E"), spaces, quotes,
// control characters, non-ASCII, an empty subject and no time.
var Odd = []broker.Attributes{
	{ID: "0b6a3c5e-2f4d-4e61-9d9a-7c1c2f0e8b11", Source: "order", Type: "order.shipped", Subject: "order-1001", Time: "2024-05-06T05:08:09.123456Z"},
	{ID: "a.b.c", Source: "$JS.API", Type: "order.*.>", Subject: "50%", Time: "0001-01-01T12:00:00Z"},
	{ID: "%2E%24", Source: "_INBOX.x", Type: "ce_type:cloudEvents:", Subject: "a/b c\t\"q\""},
	{ID: "naïve-ü-日本", Source: "Sales Order", Type: "€", Subject: ""},
	{ID: "e1", Source: "$", Type: "%", Subject: ".", Time: "9999-12-31T23:59:59.999999Z"},
}
