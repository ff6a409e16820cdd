package obs

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"regexp"
	"slices"
	"strings"

	"go.opentelemetry.io/otel/trace"
)

// NewLogger builds the process logger. Every line carries instance_id.
// Secrets are masked by where they sit, never by what they spell (see
// maskAttr): a URL's user information and query string, a key=value DSN's
// user and password, and the whole value of an attribute whose key names a
// secret. Free text is never searched for a secret's value: that garbled
// every word containing a short password ("exiting" with the password x)
// and told whoever read the log which words the password equals.
// Durations read as Go's duration strings (see DurationText).
func NewLogger(w io.Writer, format, level, instanceID string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("log level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv, ReplaceAttr: maskAttr}
	var h slog.Handler
	switch format {
	case "json":
		h = slog.NewJSONHandler(w, opts)
	case "text":
		h = slog.NewTextHandler(w, opts)
	default:
		return nil, fmt.Errorf("log format %q: want json or text", format)
	}
	log := slog.New(traceHandler{h})
	if instanceID == "" {
		// Not known yet (a command failing before its configuration is
		// read): an empty field would only mislead a search by instance.
		return log, nil
	}
	return log.With("instance_id", instanceID), nil
}

// maskAttr is the logger's ReplaceAttr. A text value (a string, an
// error's message, a Stringer's text) keeps its words and loses the
// credentials of every URL and key=value DSN in it (MaskDSN). An attribute
// whose key names a secret (IsSecretKey) is masked whole, whatever it
// holds, unless it is a number: a lease's fencing token is logged as
// "token" and is no secret.
func maskAttr(groups []string, a slog.Attr) slog.Attr {
	v := a.Value
	if v.Kind() == slog.KindDuration {
		return DurationText(groups, a)
	}
	if IsSecretKey(a.Key) {
		switch v.Kind() {
		case slog.KindInt64, slog.KindUint64, slog.KindFloat64, slog.KindBool:
			return a
		}
		if v.Kind() == slog.KindString && v.String() == "" {
			return a // nothing to hide, and "set or not" helps debugging
		}
		a.Value = slog.StringValue(Masked)
		return a
	}
	switch v.Kind() {
	case slog.KindString:
		a.Value = slog.StringValue(MaskDSN(v.String()))
	case slog.KindAny:
		if err, ok := v.Any().(error); ok {
			a.Value = slog.StringValue(MaskDSN(err.Error()))
		} else if s, ok := v.Any().(fmt.Stringer); ok {
			a.Value = slog.StringValue(MaskDSN(s.String()))
		}
	}
	return a
}

// Masked is what a masked secret reads as.
const Masked = "xxxxx"

// secretKeys are attribute keys (and configuration key names) whose value
// is a secret; IsSecretKey also takes any key ending in one of
// secretSuffixes.
var (
	secretKeys = []string{
		"password", "passwd", "pwd", "passphrase", "secret", "token", "api_key", "apikey",
		"authorization", "proxy_authorization", "cookie", "set_cookie", "credentials", "private_key",
		"seed", "nkey_seed", "jwt",
	}
	secretSuffixes = []string{"_password", "_secret", "_token", "_api_key", "_apikey", "_private_key"}
)

// IsSecretKey reports whether a log attribute or configuration key names
// a secret: password, token, secret, api_key, ... or a key ending in
// _password, _secret, _token and the like (sasl_password,
// webhook_secret). Only the last part of a dotted key counts, compared
// without case, with "-" read as "_".
func IsSecretKey(key string) bool {
	key = strings.ToLower(strings.ReplaceAll(key[strings.LastIndex(key, ".")+1:], "-", "_"))
	if slices.Contains(secretKeys, key) {
		return true
	}
	for _, s := range secretSuffixes {
		if strings.HasSuffix(key, s) {
			return true
		}
	}
	return false
}

// DurationText is a ReplaceAttr that writes a duration as Go's duration
// string ("5s", "168h0m0s"). The JSON handler writes integer nanoseconds
// (5000000000), which a reader takes for seconds or milliseconds, and which
// differs from the lines that log a duration's String() and from every
// duration in the configuration. It holds for slog.Duration and for a
// time.Duration given as a key-value pair alike: slog turns both into
// KindDuration.
func DurationText(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		a.Value = slog.StringValue(a.Value.Duration().String())
	}
	return a
}

// Credentials by their place in text. A URL inside text ends at white
// space, a quote, an angle bracket or a backslash (an escaped quote).
var (
	// Everything between "scheme://" and the last "@" before the host: a
	// user name alone may be a token (https://TOKEN@host), so the whole
	// user information goes, even with an unescaped "@" in the password.
	urlUserInfo = regexp.MustCompile(`([a-zA-Z][a-zA-Z0-9+.-]*://)[^/?#\s"'<>\\]*@`)
	// The query string: it carries tokens (?token=, ?sig=) as often as
	// settings (?sslmode=, ?application_name=).
	urlQuery = regexp.MustCompile(`([a-zA-Z][a-zA-Z0-9+.-]*://[^?#\s"'<>\\]*)\?[^#\s"'<>\\]+`)
	// A key=value DSN's password and user (pgx's connect errors name the
	// user this way: "user=app database=app").
	kvSecret = regexp.MustCompile(`(?i)(\b(?:password|user)\s*=\s*)('[^']*'|[^\s&'\x60]+)`)
)

// MaskDSN hides, by their place in s, the credentials of every URL in s (a
// database URL, a webhook URL, an error that quotes one): its user
// information and query string, so postgres://app:pw@db:5432/app?sslmode=x
// reads postgres://xxxxx@db:5432/app?xxxxx. It also hides the user and
// password of a key=value DSN. Every other word of s is left as it is.
func MaskDSN(s string) string {
	s = urlUserInfo.ReplaceAllString(s, "${1}"+Masked+"@")
	s = urlQuery.ReplaceAllString(s, "${1}?"+Masked)
	return kvSecret.ReplaceAllString(s, "${1}"+Masked)
}

// traceHandler adds trace_id and span_id to a line logged with a context
// that carries a span (InfoContext, Log): the line can then be found from
// the trace, and the trace from the line.
type traceHandler struct{ slog.Handler }

func (h traceHandler) Handle(ctx context.Context, r slog.Record) error {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		r.AddAttrs(slog.String("trace_id", sc.TraceID().String()), slog.String("span_id", sc.SpanID().String()))
	}
	return h.Handler.Handle(ctx, r)
}

func (h traceHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return traceHandler{h.Handler.WithAttrs(as)}
}

func (h traceHandler) WithGroup(name string) slog.Handler {
	return traceHandler{h.Handler.WithGroup(name)}
}

type ctxKey struct{}

// WithLogger stores a logger in ctx, for code deep in a call chain.
func WithLogger(ctx context.Context, l *slog.Logger) context.Context {
	return context.WithValue(ctx, ctxKey{}, l)
}

// Logger returns the logger stored by WithLogger, or slog.Default().
func Logger(ctx context.Context) *slog.Logger {
	if l, ok := ctx.Value(ctxKey{}).(*slog.Logger); ok {
		return l
	}
	return slog.Default()
}
