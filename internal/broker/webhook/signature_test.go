package webhook

import (
	"encoding/base64"
	"strings"
	"testing"
)

// A whsec_ secret is base64 of the key; any other is the key's bytes; a
// whsec_ secret that is not base64 is refused without quoting it.
func TestKey(t *testing.T) {
	t.Parallel()
	raw := []byte("the key bytes \x00\xff")
	for secret, want := range map[string]string{
		"":           "",
		"plain text": "plain text",
		"whsec_" + base64.StdEncoding.EncodeToString(raw): string(raw),
	} {
		got, err := Key(secret)
		if err != nil || string(got) != want {
			t.Errorf("Key(%q) = %q, %v; want %q", secret, got, err, want)
		}
	}
	for _, bad := range []string{"", "not base64!"} {
		if _, err := Key("whsec_" + bad); err == nil || bad != "" && strings.Contains(err.Error(), bad) {
			t.Errorf("Key(whsec_%s): %v; want an error that does not quote it", bad, err)
		}
	}
}

// Verify takes what Sign makes, with any of the keys, among other
// signatures, and nothing else.
func TestSignVerify(t *testing.T) {
	t.Parallel()
	k1, k2 := []byte("one"), []byte("two")
	body := []byte(`{"a": 1}`)
	sig := "v1," + Sign(k2, "msg_1", "1700000000", body)
	if !Verify([][]byte{k1, k2}, "msg_1", "1700000000", "v1,bm9wZQ== "+sig, body) {
		t.Error("a signature by the second key is refused")
	}
	for name, c := range map[string]struct{ id, ts, sigs, body string }{
		"another body":      {"msg_1", "1700000000", sig, `{"a": 2}`},
		"another id":        {"msg_2", "1700000000", sig, string(body)},
		"another timestamp": {"msg_1", "1700000001", sig, string(body)},
		"another version":   {"msg_1", "1700000000", "v2" + sig[2:], string(body)},
	} {
		if Verify([][]byte{k1, k2}, c.id, c.ts, c.sigs, []byte(c.body)) {
			t.Errorf("%s: verified", name)
		}
	}
	if Verify([][]byte{k1}, "msg_1", "1700000000", sig, body) {
		t.Error("a signature by a key not held is verified")
	}
}
