package webhook

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"math"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/worker-dev/worker/internal/inbox"
)

// handler takes one path's POSTs into the inbox.
type handler struct {
	s *Source
	h inbox.Handoff
}

// reply is the JSON body of every answer.
type reply struct {
	Outcome string `json:"outcome,omitempty"`
	Error   string `json:"error,omitempty"`
	Detail  string `json:"detail,omitempty"`
}

// settlement is what the inbox decided about a request's message.
type settlement struct {
	outcome inbox.Outcome
	after   time.Duration
}

func (hd *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s := hd.s
	// The slot is taken before the body is read: the cap bounds the
	// bodies held in memory too.
	select {
	case s.slots <- struct{}{}:
		defer func() { <-s.slots }()
	default:
		retryAfter(w, time.Second)
		answer(w, http.StatusServiceUnavailable, reply{Error: "the receiver is taking as many requests as it can; retry"})
		return
	}
	if r.ContentLength > s.cfg.MaxBody {
		answer(w, http.StatusRequestEntityTooLarge, reply{Error: "the body is larger than the receiver takes"})
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxBody))
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			answer(w, http.StatusRequestEntityTooLarge, reply{Error: "the body is larger than the receiver takes"})
		} else {
			answer(w, http.StatusBadRequest, reply{Error: "the body could not be read"})
		}
		return
	}
	if err := s.verify(r.Header, body); err != nil {
		answer(w, http.StatusUnauthorized, reply{Error: err.Error()})
		return
	}
	m := message(r, body)
	if m.ID == "" {
		// Unreachable while a signature needs webhook-id, and kept so:
		// the sender is told at once instead of a dead letter without a key.
		answer(w, http.StatusBadRequest, reply{Error: "no dedupe key: neither ce-id nor webhook-id"})
		return
	}

	ctx, cancel := context.WithTimeout(r.Context(), s.cfg.Timeout)
	defer cancel()
	settled := make(chan settlement, 1)
	d := &inbox.Delivery{Message: m, Settle: func(_ context.Context, o inbox.Outcome, after time.Duration) error {
		select {
		case settled <- settlement{o, after}:
		default: // settled once already
		}
		return nil
	}}
	hd.h.Process(ctx, []*inbox.Delivery{d})
	select {
	case st := <-settled:
		s.respond(w, st, d)
	default:
		// The timeout, the sender's disconnect or shutdown ended the work
		// before it committed.
		retryAfter(w, time.Second)
		answer(w, http.StatusServiceUnavailable, reply{Error: "the message was not processed in time; retry"})
	}
}

// respond answers what the inbox committed about d (the package's doc
// lists the answers).
func (s *Source) respond(w http.ResponseWriter, st settlement, d *inbox.Delivery) {
	switch {
	case d.Invalid != nil && (st.outcome == inbox.Dead || st.outcome == inbox.Duplicate):
		// Dead-lettered because the database cannot store its text: the
		// sender must fix the message, and a resend is refused alike.
		answer(w, http.StatusBadRequest, reply{Outcome: string(inbox.Dead), Error: d.Invalid.Error(),
			Detail: "dead-lettered in the receiver's inbox; do not resend"})
	case st.outcome == inbox.Processed:
		answer(w, http.StatusOK, reply{Outcome: string(st.outcome)})
	case st.outcome == inbox.Duplicate && d.Found == inbox.StateRecoveryRequired:
		// Not "already received": its work was cut off and may not have
		// happened. An operator decides; a resend after that is answered
		// as a duplicate.
		answer(w, http.StatusConflict, reply{Outcome: "recovery_required",
			Error: "the message's earlier processing was cut off before it committed; an operator decides whether it runs again (worker inbox recovery); resend later"})
	case st.outcome == inbox.Dead, st.outcome == inbox.Duplicate && d.Found == inbox.StateDead:
		// A 2xx, because a resend would only be a duplicate: the dead
		// letter stays in the inbox for an operator.
		answer(w, http.StatusOK, reply{Outcome: string(inbox.Dead), Detail: "dead-lettered in the receiver's inbox; do not resend"})
	case st.outcome == inbox.Duplicate:
		answer(w, s.cfg.DuplicateStatus, reply{Outcome: string(st.outcome), Detail: "already received"})
	default:
		retryAfter(w, st.after)
		answer(w, http.StatusServiceUnavailable, reply{Outcome: string(inbox.Busy), Error: "the message is being processed elsewhere, or the receiver's database failed; retry"})
	}
}

// verify checks the Standard Webhooks signature of a request: HMAC-SHA256
// with one of the keys over "webhook-id.webhook-timestamp.body", base64,
// among the space-separated "v1,<signature>" of webhook-signature, with a
// timestamp within the tolerance of now. The errors name what failed,
// never a key or the expected signature.
func (s *Source) verify(h http.Header, body []byte) error {
	id, ts, sigs := h.Get("Webhook-Id"), h.Get("Webhook-Timestamp"), h.Get("Webhook-Signature")
	if id == "" || ts == "" || sigs == "" {
		return errors.New("missing webhook-id, webhook-timestamp or webhook-signature")
	}
	secs, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return errors.New("webhook-timestamp is not a number of seconds")
	}
	if age := s.now().Sub(time.Unix(secs, 0)); age > s.cfg.Tolerance || age < -s.cfg.Tolerance {
		return errors.New("webhook-timestamp is too far from the receiver's clock")
	}
	var given [][]byte
	for _, sig := range strings.Fields(sigs) {
		version, b64, _ := strings.Cut(sig, ",")
		if got, err := base64.StdEncoding.DecodeString(b64); version == "v1" && err == nil {
			given = append(given, got)
		}
	}
	for _, key := range s.keys {
		mac := hmac.New(sha256.New, key)
		mac.Write([]byte(id))
		mac.Write([]byte{'.'})
		mac.Write([]byte(ts))
		mac.Write([]byte{'.'})
		mac.Write(body)
		want := mac.Sum(nil)
		for _, got := range given {
			if hmac.Equal(got, want) {
				return nil
			}
		}
	}
	return errors.New("no webhook-signature matches")
}

// message maps a request the way the outbox's webhook sink sends: binary
// CloudEvents (ce-id, ce-source, ce-type, ce-subject, percent-encoded),
// keyed by ce-source and ce-id; a request without ce-id is keyed by its
// webhook-id alone.
func message(r *http.Request, body []byte) inbox.Message {
	ce := func(name string) string {
		v := r.Header.Get("Ce-" + name)
		if d, err := url.PathUnescape(v); err == nil {
			return d
		}
		return v
	}
	m := inbox.Message{
		Source:  ce("Source"),
		ID:      ce("Id"),
		Type:    ce("Type"),
		Origin:  r.URL.Path,
		Headers: headers(r.Header),
		Body:    body,
	}
	if m.ID == "" {
		m.ID = r.Header.Get("Webhook-Id")
	}
	if subject := ce("Subject"); m.Source != "" || subject != "" {
		m.OrderKey = m.Source + "/" + subject
	}
	return m
}

// headers are a request's headers as one string each, without the
// credentials a proxy or the sender may add: they would be stored with a
// dead letter.
func headers(h http.Header) map[string]string {
	out := make(map[string]string, len(h))
	for k, v := range h {
		switch k {
		case "Authorization", "Proxy-Authorization", "Cookie":
			continue
		}
		out[k] = strings.Join(v, ", ")
	}
	return out
}

func retryAfter(w http.ResponseWriter, d time.Duration) {
	w.Header().Set("Retry-After", strconv.Itoa(max(1, int(math.Ceil(d.Seconds())))))
}

func answer(w http.ResponseWriter, code int, r reply) {
	b, _ := json.Marshal(r) // strings only: always marshals
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_, _ = w.Write(append(b, '\n'))
}
