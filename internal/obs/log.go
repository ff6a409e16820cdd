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
func NewLogger(w io.Writer, format, level, instanceID string, secrets ...string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("log level %q: want debug, info, warn or error", level)
	}
	m := NewMasker(secrets...)
	opts := &slog.HandlerOptions{Level: lv, ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
		switch a.Value.Kind() {
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

// Masker removes secrets from text: passwords inside URLs and key=value
// DSNs, and any literal secret it was given.
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

var (
	urlPassword = regexp.MustCompile(`([a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*:)([^@\s]*)@`)
	kvPassword  = regexp.MustCompile(`(?i)(password\s*=\s*)('[^']*'|[^\s&]+)`)
)

// Mask returns s with every secret replaced by "xxxxx".
func (m *Masker) Mask(s string) string {
	s = urlPassword.ReplaceAllString(s, "${1}xxxxx@")
	s = kvPassword.ReplaceAllString(s, "${1}xxxxx")
	for _, lit := range m.literals {
		s = strings.ReplaceAll(s, lit, "xxxxx")
	}
	return s
}

// MaskDSN hides the password of a database URL or key=value DSN.
func MaskDSN(dsn string) string { return NewMasker().Mask(dsn) }

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
