package startup

import (
	"testing"
)

func TestIsRelease(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]bool{
		"v0.1.0":                               true,
		"v1.4.2":                               true,
		"1.4.2":                                true,
		"v0.2.0-rc.1":                          true,
		"dev":                                  false,
		"":                                     false,
		"v0.1.0-dev":                           false,
		"v0.2.0-dev+e573868":                   false,
		"v0.1.0+dirty":                         false,
		"v0.0.0-20261206063516-e573868abcd1":   false,
		"v0.1.1-0.20261206063516-e573868abcd1": false,
		"v0.2.0-rc.1.0.20261206063516-e573868abcd1": false,
		"(devel)": false,
		"v01.2.3": false,
	} {
		if got := isRelease(v); got != want {
			t.Errorf("isRelease(%q) = %v, want %v", v, got, want)
		}
	}
}
