package obs

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"regexp"
	"strings"
)

// NewLogger builds the process logger. Every line carries instance_id, and
// every string value passes through Mask, so a DSN password or a registered
// secret cannot reach the output even if a caller logs it by mistake.
// Durations read as Go's duration strings (see DurationText).
func NewLogger(w io.Writer, format, level, instanceID string, secrets ...string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("log level %q: want debug, info, warn or error", level)
	}
	m := NewMasker(secrets...)
	opts := &slog.HandlerOptions{Level: lv, ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
		switch a.Value.Kind() {
		case slog.KindDuration:
			a = DurationText(groups, a)
		case slog.KindString:
			a.Value = slog.StringValue(m.Mask(a.Value.String()))
		case slog.KindAny:
			if err, ok := a.Value.Any().(error); ok {
				a.Value = slog.StringValue(m.Mask(err.Error()))
			} else if s, ok := a.Value.Any().(fmt.Stringer); ok {
				a.Value = slog.StringValue(m.Mask(s.String()))
			}
		}
		return a
	}}
	var h slog.Handler
	switch format {
	case "json":
		h = slog.NewJSONHandler(w, opts)
	case "text":
		h = slog.NewTextHandler(w, opts)
	default:
		return nil, fmt.Errorf("log format %q: want json or text", format)
	}
	log := slog.New(h)
	if instanceID == "" {
		// Not known yet (a command failing before its configuration is
		// read): an empty field would only mislead a search by instance.
		return log, nil
	}
	return log.With("instance_id", instanceID), nil
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

// Masker removes secrets from text: the user information and query string
// of URLs, the user and password of key=value DSNs, and any literal secret
// it was given.
type Masker struct{ literals []string }

// NewMasker returns a Masker that also hides the given literal secrets.
// Empty strings are ignored.
func NewMasker(secrets ...string) *Masker {
	m := &Masker{}
	for _, s := range secrets {
		if s != "" {
			m.literals = append(m.literals, s)
		}
		// A DSN's password is a secret too, in whatever text it shows up.
		if u, err := url.Parse(s); err == nil && u.User != nil {
			if p, ok := u.User.Password(); ok && p != "" {
				m.literals = append(m.literals, p, url.QueryEscape(p))
			}
		}
	}
	return m
}

// A URL inside text ends at white space, a quote, an angle bracket or a
// backslash (an escaped quote).
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

// Mask returns s with every secret replaced by "xxxxx": a URL keeps its
// scheme, host, port and path (postgres://xxxxx@db:5432/app?xxxxx).
func (m *Masker) Mask(s string) string {
	s = urlUserInfo.ReplaceAllString(s, "${1}xxxxx@")
	s = urlQuery.ReplaceAllString(s, "${1}?xxxxx")
	s = kvSecret.ReplaceAllString(s, "${1}xxxxx")
	for _, lit := range m.literals {
		s = strings.ReplaceAll(s, lit, "xxxxx")
	}
	return s
}

// MaskDSN hides the user information and query string of every URL in s
// (a database URL, a webhook URL, an error that quotes one) and the user
// and password of a key=value DSN.
func MaskDSN(s string) string { return NewMasker().Mask(s) }

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
