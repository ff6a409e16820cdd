package webhook

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"strings"
)

// SecretPrefix marks a Standard Webhooks secret: the HMAC key is the
// base64-decoded rest, not the text itself.
const SecretPrefix = "whsec_"

// Key returns the HMAC key of secret, nil for "". A whsec_ secret is
// base64, as Standard Webhooks issues them; any other secret is used as
// raw bytes. The error never quotes the value: it is the secret.
func Key(secret string) ([]byte, error) {
	if secret == "" {
		return nil, nil
	}
	b64, ok := strings.CutPrefix(secret, SecretPrefix)
	if !ok {
		return []byte(secret), nil
	}
	key, err := base64.StdEncoding.DecodeString(b64)
	if err != nil || len(key) == 0 {
		return nil, errors.New("a secret starting with whsec_ must continue with standard base64 of the key bytes")
	}
	return key, nil
}

// MAC is the Standard Webhooks v1 MAC: HMAC-SHA256 with key over
// "id.timestamp.body".
func MAC(key []byte, id, ts string, body []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(id))
	m.Write([]byte{'.'})
	m.Write([]byte(ts))
	m.Write([]byte{'.'})
	m.Write(body)
	return m.Sum(nil)
}

// Sign is the Standard Webhooks v1 signature, MAC in base64, as it goes
// after "v1," in webhook-signature.
func Sign(key []byte, id, ts string, body []byte) string {
	return base64.StdEncoding.EncodeToString(MAC(key, id, ts, body))
}

// Verify reports whether one of the space-separated "v1,<signature>" of
// sigs is the MAC of id, ts and body with one of keys. The comparison is
// constant-time.
func Verify(keys [][]byte, id, ts, sigs string, body []byte) bool {
	var given [][]byte
	for _, sig := range strings.Fields(sigs) {
		version, b64, _ := strings.Cut(sig, ",")
		if got, err := base64.StdEncoding.DecodeString(b64); version == "v1" && err == nil {
			given = append(given, got)
		}
	}
	for _, key := range keys {
		want := MAC(key, id, ts, body)
		for _, got := range given {
			if hmac.Equal(got, want) {
				return true
			}
		}
	}
	return false
}
