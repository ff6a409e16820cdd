package webhook

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	webhookbroker "github.com/worker-dev/worker/internal/broker/webhook"
	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
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
	// Reason is a refusal's reason, as inbox_webhook_refused_total counts it.
	Reason string `json:"reason,omitempty"`
	Detail string `json:"detail,omitempty"`
}

// settlement is what the inbox decided about a request's message.
type settlement struct {
	outcome inbox.Outcome
	after   time.Duration
}

func (hd *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s := hd.s
	if r.ContentLength > s.cfg.MaxBody {
		w.Header().Set("Connection", "close") // not a byte of it is read
		s.refuse(w, r, http.StatusRequestEntityTooLarge, reasonTooLarge, errTooLarge.Error(), 0)
		return
	}
	// The body first, under its deadline and within the body budget: a
	// slot is for a request the inbox can start on at once.
	body, held, err := s.readBody(w, r)
	defer s.bodies.give(held)
	switch {
	case errors.Is(err, errTooLarge):
		s.refuse(w, r, http.StatusRequestEntityTooLarge, reasonTooLarge, err.Error(), 0)
		return
	case errors.Is(err, errSlowBody):
		s.refuse(w, r, http.StatusRequestTimeout, reasonSlowBody, err.Error(), 0)
		return
	case errors.Is(err, errBodyBudget):
		s.refuse(w, r, http.StatusServiceUnavailable, reasonBusy, err.Error(), time.Second)
		return
	case err != nil:
		s.refuse(w, r, http.StatusBadRequest, reasonBadRequest, err.Error(), 0)
		return
	}
	if err := s.verify(r.Header, body); err != nil {
		s.refuse(w, r, http.StatusUnauthorized, reasonBadSignature, err.Error(), 0)
		return
	}
	d := s.delivery(r, body)
	if d.Invalid != nil {
		// The sender is told at once, and nothing is stored: a dead letter
		// without a key could never be retried.
		s.refuse(w, r, http.StatusBadRequest, reasonBadRequest, d.Invalid.Error(), 0)
		return
	}
	select {
	case s.slots <- struct{}{}:
		defer func() { <-s.slots }()
	default:
		s.refuse(w, r, http.StatusServiceUnavailable, reasonBusy, "the receiver is processing as many requests as it takes at once (max_in_flight)", time.Second)
		return
	}

	ctx, cancel := context.WithTimeout(r.Context(), s.cfg.Timeout)
	defer cancel()
	settled := make(chan settlement, 1)
	d.Settle = func(_ context.Context, o inbox.Outcome, after time.Duration) error {
		select {
		case settled <- settlement{o, after}:
		default: // settled once already
		}
		return nil
	}
	hd.h.Process(ctx, []*inbox.Delivery{d})
	select {
	case st := <-settled:
		s.respond(w, r, st, d)
	default:
		// The timeout, the sender's disconnect or shutdown ended the work
		// before it committed.
		s.refuse(w, r, http.StatusServiceUnavailable, reasonTimeout, "the message was not processed within the receiver's timeout; it was not applied", time.Second)
	}
}

// respond answers what the inbox committed about d (the package's doc
// lists the answers).
func (s *Source) respond(w http.ResponseWriter, r *http.Request, st settlement, d *inbox.Delivery) {
	switch {
	case d.Invalid != nil && (st.outcome == inbox.Dead || st.outcome == inbox.Duplicate):
		// Dead-lettered because the database cannot store its text: the
		// sender must fix the message, and a resend is refused alike.
		s.refused.refuse(r.RemoteAddr, r.Header.Get("Webhook-Id"), http.StatusBadRequest, reasonUnstorable, d.Invalid.Error())
		answer(w, http.StatusBadRequest, reply{Outcome: string(inbox.Dead), Error: d.Invalid.Error(), Reason: reasonUnstorable,
			Detail: "dead-lettered in the receiver's inbox; do not resend"})
	case st.outcome == inbox.Processed:
		answer(w, http.StatusOK, reply{Outcome: string(st.outcome)})
	case st.outcome == inbox.Duplicate && d.Found == inbox.StateRecoveryRequired:
		// Not "already received": its work was cut off and may not have
		// happened. An operator decides; a resend after that is answered
		// as a duplicate.
		const why = "the message's earlier processing was cut off before it committed; an operator decides whether it runs again (worker inbox recovery); resend later"
		s.refused.refuse(r.RemoteAddr, r.Header.Get("Webhook-Id"), http.StatusConflict, reasonRecovery, why)
		answer(w, http.StatusConflict, reply{Outcome: "recovery_required", Error: why, Reason: reasonRecovery})
	case st.outcome == inbox.Dead, st.outcome == inbox.Duplicate && d.Found == inbox.StateDead:
		// A 2xx, because a resend would only be a duplicate: the dead
		// letter stays in the inbox for an operator.
		answer(w, http.StatusOK, reply{Outcome: string(inbox.Dead), Detail: "dead-lettered in the receiver's inbox; do not resend"})
	case st.outcome == inbox.Unavailable:
		s.refuse(w, r, http.StatusServiceUnavailable, reasonUnavailable, "the receiver's database failed; the message was not applied", st.after)
	case st.outcome == inbox.Duplicate:
		answer(w, s.cfg.DuplicateStatus, reply{Outcome: string(st.outcome), Detail: "already received"})
	default:
		s.refuse(w, r, http.StatusServiceUnavailable, reasonInProgress, "the same message is being processed by another request or replica", st.after)
	}
}

// refuse answers status with reason, counts and logs it. A positive
// retry sets Retry-After.
func (s *Source) refuse(w http.ResponseWriter, r *http.Request, status int, reason, detail string, retry time.Duration) {
	s.refused.refuse(r.RemoteAddr, r.Header.Get("Webhook-Id"), status, reason, detail)
	if retry > 0 {
		retryAfter(w, retry)
	}
	rep := reply{Error: detail, Reason: reason}
	switch reason {
	case reasonInProgress, reasonUnavailable, reasonTimeout, reasonBusy:
		rep.Outcome = string(inbox.Busy) // as before: a sender may key on it
	}
	answer(w, status, rep)
}

// elsewhere answers what the source's pattern does not match: another
// method on its path (405), or another path (404).
func (s *Source) elsewhere(w http.ResponseWriter, r *http.Request) {
	// Its body is not read: the server would otherwise read it at the
	// sender's pace before answering.
	w.Header().Set("Connection", "close")
	if r.URL.Path == s.cfg.Path {
		w.Header().Set("Allow", http.MethodPost)
		s.refuse(w, r, http.StatusMethodNotAllowed, reasonMethod, "the receiver takes POST only", 0)
		return
	}
	s.refuse(w, r, http.StatusNotFound, reasonNotFound, "the receiver takes messages on another path", 0)
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
	if webhookbroker.Verify(s.keys, id, ts, sigs, body) {
		return nil
	}
	return errors.New("no webhook-signature matches")
}

// delivery maps a request the way the outbox's webhook sink sends:
// binary CloudEvents, keyed by their attributes (inbox.CloudEvent). A
// request without ce-id is keyed by the source's configured key, and
// without one by its webhook-id (the inbox's native id). Invalid is set
// when the configured key is missing from the request.
func (s *Source) delivery(r *http.Request, body []byte) *inbox.Delivery {
	m := inbox.CloudEvent(webhookbroker.Decode(r.Header))
	m.Origin, m.Headers, m.Body = r.URL.Path, headers(r.Header), body
	d := &inbox.Delivery{Message: m, NativeID: r.Header.Get("Webhook-Id")}
	if m.ID == "" && s.dedupe != (inboxconfig.KeySpec{}) {
		d.Invalid = inbox.ApplyKey(s.dedupe, &d.Message)
	}
	return d
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
